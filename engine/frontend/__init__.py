"""The engine's public faces, above core/, sampling/ and model/.

    llm_engine.py     add_request / step / abort: one step of the whole engine
    llm.py            the offline API: LLM.generate / LLM.chat
    async_engine.py   the engine thread and its asyncio side (the only asyncio in engine/)
    bridge.py         what crosses between them: commands, stats snapshots, errors
    request_stream.py one request's stream of output deltas
    chat_template.py  chat messages -> prompt text through the model's template
"""
