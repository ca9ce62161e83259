"""Tool-call parsers: each turns a model's text into content and tool calls (see ``base``); the built-in
formats (hermes, llama3_json, pythonic, mistral) register through ``pagedkv_register_tool_parsers`` like a
third party's would."""
