"""The SmolLM2-135M-shape model (kvtiers.commands.tinymodel, ``smollm2-135m``) answers each prompt
differently and not with one token repeated, so a serving check that compares answers can see
wrong KV (issue 55 item 1: with transformers' default 0.02 initialisation every prompt got one
token repeated); its weights' standard deviation is part of its directory name, so a model made
before is not reused; the tests' tiny model keeps its directory (its identity)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtiers.commands import tinymodel  # noqa: E402

PROMPTS = ["the system of kato rimo is", "user: tell me about zen and lor.", "a quick brown fox jumps over",
           "kimfin ber cal toqua ish ol ux"]
NEW = 12


def test_shape_model_answers_vary_across_prompts_and_tokens() -> None:
    path = tinymodel.make_named_model("smollm2-135m")
    params = json.loads((path / ".kvtiers-tinymodel").read_text())
    assert params["initializer_range"] == 0.1 and params["num_layers"] == 30
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    answers = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread copes best
    try:
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.eos_token_id)
            answers.append(out[0, ids.shape[1]:].tolist())
    finally:
        torch.set_num_threads(threads)
    assert len({tuple(a) for a in answers}) == len(PROMPTS), answers  # every prompt its own answer
    assert all(len(set(a)) >= NEW // 2 for a in answers), answers  # not a token (or two) repeated


def test_initializer_range_is_part_of_the_identity_and_defaults_keep_theirs(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVTIERS_BUILD_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(tinymodel, "_save_model", lambda path, p, vocab: calls.append(p))
    monkeypatch.setattr(tinymodel, "_train_tokenizer", lambda v, s: type("T", (), {
        "save_pretrained": lambda self, d: None, "__len__": lambda self: v})())
    plain = tinymodel.make_tiny_model()
    assert plain.name == "tiny-llama-465eb53d5ab1"  # the tests' tiny model: same directory as before
    scaled = tinymodel.make_tiny_model(initializer_range=0.2)
    assert scaled != plain and calls[-1]["initializer_range"] == 0.2
    shape = tinymodel.make_named_model("smollm2-135m")
    assert shape.name != tinymodel.make_tiny_model(**{k: v for k, v in tinymodel.SHAPES["smollm2-135m"].items()
                                                      if k != "initializer_range"}).name
    with pytest.raises(ValueError, match="initializer_range must be a number"):
        tinymodel.make_tiny_model(initializer_range=-1)
