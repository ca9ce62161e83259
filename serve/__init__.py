"""An OpenAI-compatible HTTP server over the engine (``engine serve``; needs the ``serve`` extra).

:class:`~pagedkv.serve.async_engine.AsyncEngine` runs the engine loop on its own thread;
:func:`~pagedkv.serve.openai_app.build_app` is the FastAPI app, and
:func:`~pagedkv.serve.server.make_server` the uvicorn server over both (the command line is
``cli/serve.py``). Importing this package imports neither FastAPI nor uvicorn.
"""
