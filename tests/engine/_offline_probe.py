"""An offline ``vllm.LLM`` driven over stdin/stdout, like ``_offline.py``, whose ``generate``
also answers what the version-stamp and cache tests check: each output's token ids,
``num_cached_tokens`` (prefix-cache hits of its prompt) and vLLM's ``weight_versions``.

Started by :class:`ProbeEngine` (``test_vllm_stamps.py``); ops: ``generate``,
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``, ``weight_version``, ``exit``.
"""

from __future__ import annotations

import json
import sys


def _answer(obj: dict) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    kwargs = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(**kwargs)
    except BaseException as e:
        _answer({"error": f"{type(e).__name__}: {e}"})
        sys.exit(3)
    _answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "generate":
                sp = SamplingParams(temperature=0, max_tokens=cmd.get("max_tokens", 8), ignore_eos=True)
                outs = llm.generate(cmd["prompts"], sp, use_tqdm=False)
                result = [{"ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                           "cached": o.num_cached_tokens,
                           "weight_versions": [[s.version, s.start, s.end] for s in o.outputs[0].weight_versions or ()]}
                          for o in outs]
            elif op == "init_weight_transfer_engine":
                result = llm.init_weight_transfer_engine({"init_info": cmd.get("init_info", {})})
            elif op == "start_weight_update":
                result = llm.start_weight_update()
            elif op == "update_weights":
                result = llm.update_weights({"update_info": cmd["update_info"]})
            elif op == "finish_weight_update":
                result = llm.finish_weight_update(weight_version=cmd.get("weight_version"))
            elif op == "weight_version":
                result = llm.get_weight_version()
            elif op == "exit":
                _answer({"ok": None})
                break
            else:
                raise ValueError(f"unknown op {op!r}")
            _answer({"ok": result})
        except Exception as e:
            _answer({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
