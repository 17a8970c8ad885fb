"""Tool calling: the request-side plan (tools, tool_choice, grammar) and the parsers
that read calls out of generated text, one module per format, named in registry.py."""
