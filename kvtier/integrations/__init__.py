"""Engine adapters: transformers (``hf``) and vLLM (``vllm``); each needs its optional extra."""
