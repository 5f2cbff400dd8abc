"""serve/: an OpenAI-compatible server on a loaded model (`moe-offload serve`); needs the `serve` extra."""
