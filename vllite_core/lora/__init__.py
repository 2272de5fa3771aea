"""Multi-LoRA: PEFT adapters served per request over one base model (docs/lora.md)."""
