"""A small causal language model made on this machine, for the tests and demos that need a real
model where no hub can be reached: random weights saved as safetensors, and a byte-level BPE
tokenizer trained with ``tokenizers`` on a generated corpus.

The directory is a normal Hugging Face model directory (``config.json``, ``model.safetensors``,
``tokenizer.json``, ...), so transformers' ``from_pretrained`` and vLLM's model loader read it as
they read any checkpoint. Models are cached under ``build/models/`` (or ``$KVTIERS_BUILD_DIR``):
the same arguments give the same directory, made once, atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

__all__ = ["ARCHITECTURES", "SHAPES", "build_dir", "make_named_model", "make_tiny_model"]

#: the shapes this module makes: ``arch`` -> transformers' class name
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen3_next": "Qwen3NextForCausalLM"}
#: what a ``qwen3_next`` model is besides the common shape: a hybrid of gated delta net (linear
#: attention, an SSM-like state per sequence) and full attention layers, alternating, with a
#: small mixture of experts; larger random weights than the default, so greedy output varies
_QWEN3_NEXT = dict(linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_value_head_dim=64, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=128, shared_expert_intermediate_size=128, initializer_range=0.1)
#: published models' shapes by name, made by :func:`make_named_model` with random weights and the
#: local tokenizer (2048 tokens). ``smollm2-135m``: HuggingFaceTB/SmolLM2-135M's config (Llama,
#: 30 layers, hidden 576, 9 heads, 3 KV heads, MLP 1536; 108.6M parameters with this vocabulary
#: and an untied output layer): 22.5 KiB of bf16 KV per token. Its weights are drawn with a
#: standard deviation of 0.1, not transformers' 0.02: at 0.02 the residual stream is the last
#: token's embedding, so the next token is a function of the last one and greedy decoding settles
#: on one token repeated, whatever the prompt; at 0.1 attention moves the logits and the answers
#: differ from prompt to prompt (tests/test_tinymodel_varies.py). Random weights amplify rounding:
#: a prompt's answer with its prefix computed and with it cached differ by up to 0.17 nats at 0.1
#: (0.65 at 0.2, tokens parting after ~10), so checks compare an answer with the plain run's
#: answer taken the same way (kvtiers.commands.bench.serve_identity)
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(arch="llama", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                         intermediate_size=1536, max_position_embeddings=8192, initializer_range=0.1),
}
_DONE = ".kvtiers-tinymodel"  # written last: a directory without it is incomplete


def build_dir() -> Path:
    """The project's build folder: ``$KVTIERS_BUILD_DIR``, else ``build`` in the working directory."""
    return Path(os.environ.get("KVTIERS_BUILD_DIR", "build")).resolve()


def make_tiny_model(
    out_dir: str | os.PathLike | None = None,
    *,
    arch: str = "llama",
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 2048,
    max_position_embeddings: int = 16384,
    dtype: str = "bfloat16",
    seed: int = 0,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    initializer_range: float | None = None,
) -> Path:
    """Make (or find in the cache) a ``arch``-shaped causal LM and return its directory.

    ``num_kv_heads < num_heads`` gives grouped-query attention. ``dtype`` is the dtype of the
    saved weights (``bfloat16``, ``float16`` or ``float32``). The weights are random but fixed by
    ``seed``; the tokenizer has ``vocab_size`` tokens. With ``out_dir`` None the model goes to
    ``build_dir()/models/tiny-<arch>-<digest of the arguments>``.

    ``arch="qwen3_next"`` makes an SSM hybrid: gated delta net layers (even) and full attention
    layers (odd), a small mixture of experts; ``num_layers`` must be even.

    ``layer_types`` (one per layer, ``"full_attention"`` or ``"sliding_attention"``) with
    ``sliding_window`` (tokens) makes a hybrid: its sliding layers attend to the last
    ``sliding_window`` tokens only (vLLM honours them: one KV cache group per kind).

    ``initializer_range``: the standard deviation of the random weights (None: transformers'
    default for ``arch``, 0.02 for llama). It is part of the model's identity (its directory).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"make_tiny_model: arch {arch!r} is not one of {sorted(ARCHITECTURES)}")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"make_tiny_model: dtype {dtype!r} is not bfloat16, float16 or float32")
    if num_heads % num_kv_heads or hidden_size % num_heads:
        raise ValueError(
            f"make_tiny_model: hidden_size {hidden_size}, num_heads {num_heads} and num_kv_heads "
            f"{num_kv_heads} must divide evenly"
        )
    if arch == "qwen3_next" and (num_layers % 2 or layer_types is not None):
        raise ValueError("make_tiny_model: qwen3_next alternates its layers itself: an even num_layers, no layer_types")
    params = dict(arch=arch, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                  num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, vocab_size=vocab_size,
                  max_position_embeddings=max_position_embeddings, dtype=dtype, seed=seed, version=1)
    if layer_types is not None or sliding_window is not None:  # only then: other models keep their digest
        kinds = ("full_attention", "sliding_attention")
        if layer_types is None or len(layer_types) != num_layers or any(t not in kinds for t in layer_types):
            raise ValueError(f"make_tiny_model: layer_types must give one of {kinds} for each of the {num_layers} "
                             f"layers, got {layer_types!r}")
        if "sliding_attention" in layer_types and (not isinstance(sliding_window, int) or sliding_window <= 0):
            raise ValueError(f"make_tiny_model: sliding layers need sliding_window (tokens) > 0, "
                             f"got {sliding_window!r}")
        params.update(layer_types=list(layer_types), sliding_window=sliding_window)
    if initializer_range is not None:  # only then: other models keep their digest
        if not isinstance(initializer_range, (int, float)) or not 0 < initializer_range < 10:
            raise ValueError(f"make_tiny_model: initializer_range must be a number in (0, 10), "
                             f"got {initializer_range!r}")
        params["initializer_range"] = float(initializer_range)
    if out_dir is None:
        digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
        out = build_dir() / "models" / f"tiny-{arch}-{digest}"
    else:
        out = Path(out_dir).resolve()
    if (out / _DONE).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer = _train_tokenizer(vocab_size, seed)
        tokenizer.save_pretrained(tmp)
        _save_model(tmp, params, len(tokenizer))
        (tmp / _DONE).write_text(json.dumps(params, sort_keys=True) + "\n")
        try:
            tmp.rename(out)
        except OSError:  # another process made it first (or out_dir exists): keep theirs if complete
            if not (out / _DONE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def make_named_model(name: str, out_dir: str | os.PathLike | None = None) -> Path:
    """Make (or find in the cache) a model of the published shape ``name`` (a key of
    :data:`SHAPES`, any case) and return its directory, as :func:`make_tiny_model` does."""
    shape = SHAPES.get(name.lower())
    if shape is None:
        raise ValueError(f"no model shape named {name!r}: the shapes are {', '.join(sorted(SHAPES))}")
    return make_tiny_model(out_dir, **shape)


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic English-like text: enough distinct words for a few thousand BPE merges."""
    rng = random.Random(seed)
    syllables = ["ka", "to", "ri", "mo", "se", "la", "vi", "nu", "pe", "do", "qua", "zen", "tor", "ish",
                 "ar", "en", "ol", "ux", "ber", "cal", "fin", "gor", "hul", "jes", "kim", "lor"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    words += ["the", "a", "of", "and", "to", "in", "is", "you", "that", "it", "system", "user", "assistant"]
    out = []
    for _ in range(lines):
        n = rng.randint(5, 20)
        out.append(" ".join(rng.choice(words) for _ in range(n)) + rng.choice([".", "?", "!", ","]))
    return out


def _train_tokenizer(vocab_size: int, seed: int):
    """A byte-level BPE tokenizer (every string encodes) as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=1 << 20)


def _save_model(path: Path, p: dict, vocab: int) -> None:
    import torch
    import transformers

    config_cls = getattr(transformers, ARCHITECTURES[p["arch"]].replace("ForCausalLM", "Config"))
    extra: dict = {}
    if p["arch"] == "qwen3_next":
        extra = dict(_QWEN3_NEXT, head_dim=p["hidden_size"] // p["num_heads"],
                     layer_types=["linear_attention", "full_attention"] * (p["num_layers"] // 2))
    config = config_cls(
        **extra, vocab_size=vocab, hidden_size=p["hidden_size"], intermediate_size=p["intermediate_size"],
        num_hidden_layers=p["num_layers"], num_attention_heads=p["num_heads"],
        num_key_value_heads=p["num_kv_heads"], max_position_embeddings=p["max_position_embeddings"],
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    if "initializer_range" in p:
        config.initializer_range = p["initializer_range"]
    config.architectures = [ARCHITECTURES[p["arch"]]]
    if "layer_types" in p:
        config.layer_types = p["layer_types"]
        config.sliding_window = p["sliding_window"]
    model_cls = getattr(transformers, ARCHITECTURES[p["arch"]])
    with torch.random.fork_rng():
        torch.manual_seed(p["seed"])
        model = model_cls(config)
    model = model.to(getattr(torch, p["dtype"]))
    model.save_pretrained(path, safe_serialization=True)
