"""The request machinery: server state and admit(), prep lanes, chat and completions
preparation, constraints, the admitted request's stream and its SSE, and the
pieces of an answer (echo, logprobs, usage, token bytes, reasoning)."""
