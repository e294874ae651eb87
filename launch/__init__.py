"""The Hydra launcher: ``torchrun launch/train.py [overrides]`` (schemas, builders, ``train(cfg)``)."""
