"""A vLLM worker extension (``worker_extension_cls``) for the verl + vLLM test: the receiving
end of the rollout server adapter's buckets, loading them as vLLM's own reload does
(``initialize_layerwise_reload``, ``model.load_weights`` per bucket, ``finalize_layerwise_reload``:
on CPU, linear weights are prepacked after loading, so the finalize step matters)."""

from __future__ import annotations


class LoadBuckets:
    def verl_begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.model)

    def verl_load(self, bucket: list) -> int:
        self.model_runner.model.load_weights(iter(bucket))
        return len(bucket)

    def verl_end(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model_runner.model, self.model_runner.model_config)
