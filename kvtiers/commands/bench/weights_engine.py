"""One vLLM engine start for ``kvtiers bench weights``: build ``LLM(...)``, answer one token, report
the wall-clock times (``time.time()``) and exit at once. Run in vLLM's environment::

    python -m kvtiers.commands.bench.weights_engine JOB.json OUT.json

``JOB.json``: ``{"model": dir, "load_format": "auto" | "kvtiers", "model_loader_extra_config":
{...}, "prompt": [token ids]}``. ``OUT.json``: ``imported`` (vLLM imported), ``ready`` (the
engine built, weights loaded), ``first_token`` (the first token answered), ``tokens``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ..vllm_engine import ENGINE_ENV


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kvtiers.commands.bench.weights_engine JOB.json OUT.json", file=sys.stderr)
        return 2
    job = json.loads(Path(args[0]).read_text())
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams

    imported = time.time()
    extra = job.get("model_loader_extra_config") or {}
    llm = LLM(model=job["model"], dtype="bfloat16", max_model_len=256, max_num_seqs=1, enforce_eager=True, seed=0,
              load_format=job.get("load_format", "auto"), **({"model_loader_extra_config": extra} if extra else {}))
    ready = time.time()
    (out,) = llm.generate([{"prompt_token_ids": job["prompt"]}], SamplingParams(temperature=0.0, max_tokens=1),
                          use_tqdm=False)
    first = time.time()
    tmp = Path(args[1] + ".tmp")
    tmp.write_text(json.dumps({"imported": imported, "ready": ready, "first_token": first,
                               "tokens": list(out.outputs[0].token_ids)}))
    tmp.replace(args[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the measurement is done: no teardown (the caller ends the process group)


if __name__ == "__main__":
    sys.exit(main())
