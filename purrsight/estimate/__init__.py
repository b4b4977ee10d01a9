"""What a config costs before it runs: ``train_phase2.py estimate`` (docs/SCALING.md).

meta_model.py builds the config's model on the meta device from config files alone; memory.py
counts its bytes per GPU under ddp and fsdp and runs one training step on meta for the
activations; command.py is the subcommand. Nothing here reads a weight file.
"""
