"""CIFAR-10 example: a small ResNet trained with the ``safe_ddp`` strategy on CPU or GPU."""
