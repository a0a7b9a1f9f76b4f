"""An offline ``vllm.LLM`` engine driven over stdin/stdout, one JSON object per line.

Started by the engine tests as ``python _offline.py '<LLM kwargs as JSON>'``; answers
``{"ready": true}`` once the engine is up (or ``{"error": ...}`` and exits), then runs
commands: ``generate``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``, ``weight_version``, ``reload_weights`` (vLLM's own loader reads
the weight files of directory ``path`` into the running model, then the prefix cache is
dropped), ``exit``. Each answer is ``{"ok": result}`` or ``{"error": "Type: message"}``.
vLLM's own logs go to stderr.
"""

from __future__ import annotations

import json
import sys


def _answer(obj: dict) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def generate(llm, cmd: dict):
    """``generate``'s answer: greedy token ids and text per prompt."""
    outs = _greedy(llm, cmd)
    return {"ids": [list(o.outputs[0].token_ids) for o in outs], "text": [o.outputs[0].text for o in outs]}


def _greedy(llm, cmd: dict):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=cmd.get("max_tokens", 8), ignore_eos=True)
    return llm.generate(cmd["prompts"], sp, use_tqdm=False)


def main(answer_generate=generate) -> None:
    """The loop; ``answer_generate(llm, cmd)`` builds ``generate``'s answer (a probe script
    passes its own, ``_offline_probe.py``)."""
    kwargs = json.loads(sys.argv[1])
    from vllm import LLM

    try:
        llm = LLM(**kwargs)
    except BaseException as e:  # report the start error, then exit non-zero
        _answer({"error": f"{type(e).__name__}: {e}"})
        sys.exit(3)
    _answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "generate":
                result = answer_generate(llm, cmd)
            elif op == "init_weight_transfer_engine":
                result = llm.init_weight_transfer_engine({"init_info": cmd.get("init_info", {})})
            elif op == "start_weight_update":
                result = llm.start_weight_update()
            elif op == "update_weights":
                result = llm.update_weights({"update_info": cmd["update_info"]})
            elif op == "finish_weight_update":
                result = llm.finish_weight_update(weight_version=cmd.get("weight_version"))
            elif op == "reload_weights":
                llm.collective_rpc("reload_weights", kwargs={"weights_path": cmd["path"]})
                result = llm.reset_prefix_cache()
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
