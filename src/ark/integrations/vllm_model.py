"""A Llama-architecture model made on this machine, for vLLM P/D runs without a model hub.

    from ark.integrations.vllm_model import ModelShape, make_model
    make_model("/tmp/ark-llama")          # 4 layers, hidden 512, 8 KV heads, fp32: 16 KiB of KV per token

Random weights (seeded) and a word-level tokenizer whose words are ``w0 .. w4066`` and the
letters ``a .. z``: prompts are space-separated words (:func:`prompt`). The output is
meaningless but deterministic, which is all a KV-transfer experiment needs: greedy decoding
of a prompt gives the same tokens on one instance and under P/D exactly when the moved KV
cache is right. The shape sets the KV bytes per token (``2 x layers x kv_heads x head_dim x
4`` bytes in fp32), so a prompt of a few hundred tokens makes a KV transfer of several MB
while prefill compute stays small on a CPU.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SPECIALS = ("<unk>", "<s>", "</s>")


@dataclass(frozen=True)
class ModelShape:
    layers: int = 4
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 8
    intermediate: int = 1024
    vocab: int = 4096
    max_len: int = 2048
    init_std: float = 0.08  # larger than the usual 0.02, so that greedy output does not repeat one token

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 keys and values of every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 4

    def words(self) -> list[str]:
        letters = [chr(ord("a") + i) for i in range(26)]
        return [f"w{i}" for i in range(self.vocab - len(SPECIALS) - len(letters))] + letters


def make_model(path: str | Path, shape: ModelShape = ModelShape(), seed: int = 0) -> Path:
    """Write the model (safetensors, config) and its tokenizer to ``path``; returns it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate([*SPECIALS, *shape.words()])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces again
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)
    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.max_len,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, shape.init_std)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out


def prompt(tokens: int, seed: int, shape: ModelShape = ModelShape()) -> str:
    """``tokens`` words drawn by ``seed`` (one token each: the tokenizer splits on spaces)."""
    rng = random.Random(seed)
    words = shape.words()
    return " ".join(rng.choice(words) for _ in range(tokens))
