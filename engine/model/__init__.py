"""The model side of a step: KV tensors, batch preparation, forward, sample.

    model_runner.py       owns the KV cache and the model; executes a SchedulerOutput
    step_inputs.py        SchedulerOutput -> flat token batch + AttentionMetadata
    attention_metadata.py how the flat batch maps onto sequences and cache slots
    model_info.py         loads config, tokenizer and runner for an EngineConfig
    cpu_allocator.py      glibc tuning; huge pages for the CPU KV cache and weights
    layers/               shared building blocks, each calling kernels/
    models/               one short file per family, composed of layers/; loader.py
    distributed/          tensor parallelism on torch.distributed
"""
