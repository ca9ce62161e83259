"""The HTTP machinery around the request schema: bounded admission (body, parse, tokenize) and the metrics."""
