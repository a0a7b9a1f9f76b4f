"""An offline ``vllm.LLM`` driven over stdin/stdout, like ``_offline.py`` (its loop and
ops), whose ``generate`` also answers what the version-stamp and cache tests check: each
output's token ids, ``num_cached_tokens`` (prefix-cache hits of its prompt) and vLLM's
``weight_versions``.

Started by :class:`ProbeEngine` (``test_vllm_stamps.py``).
"""

from __future__ import annotations

from _offline import _greedy, main


def probe(llm, cmd: dict) -> list:
    return [{"ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text, "cached": o.num_cached_tokens,
             "weight_versions": [[s.version, s.start, s.end] for s in o.outputs[0].weight_versions or ()]}
            for o in _greedy(llm, cmd)]


if __name__ == "__main__":
    main(probe)
