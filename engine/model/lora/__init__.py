"""LoRA adapters over the one base model: a PEFT folder read and checked
(adapter.py), the slots every adapted projection holds (stacks.py), and which
adapters the runner keeps and which slot each row of a step reads (manager.py).
"""
