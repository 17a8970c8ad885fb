"""The OpenAI wire types as msgspec Structs: requests, replies, and vLLM's prompt logprobs."""
