"""unbubble: bubble-free asynchronous pipeline-parallel training for PyTorch."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``unbubble.train_model`` (train a model you already have; ``unbubble.train.train_model``), imported
    on first use so that ``import unbubble.schedules`` stays free of torch."""
    if name == "train_model":
        from unbubble.train import train_model

        return train_model
    raise AttributeError(f"module 'unbubble' has no attribute {name!r}")
