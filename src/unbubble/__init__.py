"""unbubble: bubble-free asynchronous pipeline-parallel training for PyTorch."""

__version__ = "0.1.0"
