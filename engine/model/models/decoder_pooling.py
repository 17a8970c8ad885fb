"""A decoder family as a pooling model: its last hidden states, or a classifier over them.

Embedders built on a chat model's layers (Qwen3-Embedding, gte-Qwen2) are the
decoder itself without its LM head: the hidden state after the final norm is
the answer, taken at the last token (the only one whose attention saw the whole
input). Their checkpoints name the bare model (`Qwen3Model`, tensors without the
`model.` prefix, which load_weights strips anyway), or a generator is served so
with `--convert embed`.

A sequence classifier (`Qwen3ForSequenceClassification`, Llama's, and
`--convert classify`) adds HF's `score`: one linear layer, no bias, from the
last token's hidden state to a logit per label.

Both keep the decoder's causal attention, so a cached prefix's K/V are exact
for them (prefix caching stays on where the pooled row is the last).
"""

from __future__ import annotations

from engine.model.layers.linear import Linear
from engine.model.models.llama import LlamaForCausalLM


def embedding_model(base: type[LlamaForCausalLM]) -> type[LlamaForCausalLM]:
    """`base` with no LM head: forward's hidden states are what it serves."""

    class Embedding(base):
        CAUSAL = True
        token_types = False  # reads no token_type_ids
        TENSOR_PARALLEL = False
        DEFAULT_POOLING = "LAST"
        num_labels = None
        labels: tuple[str, ...] = ()

        def __init__(self, hf_config, max_positions: int, kernels, partition=None,
                     group=None) -> None:
            super().__init__(hf_config, max_positions, kernels, partition, group)
            self.lm_head = None  # never read: a checkpoint's head is skipped on load

        def quantize_weights(self, type_name: str) -> None:
            raise ValueError("a pooling model is served in its float weights: drop --quantization")

    Embedding.__name__ = Embedding.__qualname__ = base.__name__.replace("ForCausalLM", "Model")
    return Embedding


def classifier_model(base: type[LlamaForCausalLM]) -> type[LlamaForCausalLM]:
    """`base` with HF's sequence-classification head (`score`) on the last token."""

    class Classifier(embedding_model(base)):
        def __init__(self, hf_config, max_positions: int, kernels, partition=None,
                     group=None) -> None:
            super().__init__(hf_config, max_positions, kernels, partition, group)
            names = getattr(hf_config, "id2label", None) or {}
            self.num_labels = getattr(hf_config, "num_labels", None) or len(names) or 1
            self.labels = tuple(str(names.get(i, names.get(str(i), f"LABEL_{i}")))
                                for i in range(self.num_labels))
            self.score = Linear(self.args.hidden_size, self.num_labels, False, kernels)

        def classify(self, pooled):
            """[n, hidden] last-token rows -> [n, num_labels] logits."""
            return self.score(pooled)

    Classifier.__name__ = Classifier.__qualname__ = base.__name__.replace(
        "ForCausalLM", "ForSequenceClassification")
    return Classifier
