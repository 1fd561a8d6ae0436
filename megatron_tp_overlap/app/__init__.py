"""The main job: a Hydra app that trains a GPT with Megatron-LM and tunes the overlap config live."""
