"""A decoder from a model library: transformers' LlamaForCausalLM from a tiny config (nothing
downloaded), three optimizer steps of AdamW with two micro-batches of gradient accumulation and
activation checkpointing, then greedy ``generate`` of four tokens with its cache.

Kernels compute nothing on the fake, so no step may depend on the values: ``generate`` has no
end-of-sequence token, and its check "every sequence finished" (a flag computed on the device
and read back) is still made but its answer, whatever bytes the memory held, is replaced by the
length alone, which is what a GPU would answer without an end-of-sequence token.
"""

import torch
import transformers

import _figures

torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    bos_token_id=None, eos_token_id=None, pad_token_id=0,
)  # fmt: skip
model = transformers.LlamaForCausalLM(config).cuda()
# The model's default attention: PyTorch's scaled_dot_product_attention (its memory-efficient
# kernels on float32), forward and backward.
assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
model.gradient_checkpointing_enable()
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
_figures.step("model")

ACCUMULATE = 2
for step in range(3):
    for micro in range(ACCUMULATE):
        ids = torch.randint(1, 256, (2, 16), device="cuda")
        loss = model(input_ids=ids, labels=ids).loss / ACCUMULATE
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _figures.step(f"train {step}")

PROMPT, NEW_TOKENS = 8, 4
check_on_the_device = transformers.generation.utils.StopCheck.__call__


def stop_at_the_length(self, unfinished_sequences, tokens, length):
    check_on_the_device(self, unfinished_sequences, tokens, length)
    return length >= PROMPT + NEW_TOKENS


transformers.generation.utils.StopCheck.__call__ = stop_at_the_length
model.eval()
prompt = torch.randint(1, 256, (2, PROMPT), device="cuda")
with torch.no_grad():
    out = model.generate(
        prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
_figures.note("generated_shape", list(out.shape))
_figures.step("generate")
_figures.write()
