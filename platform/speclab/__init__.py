"""speclab: speculative decoding on Ray (engine in ``speclab.decoding``, pure PyTorch).

Import-light on purpose: ``import speclab`` pulls in neither Ray nor MLflow.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # lazy: keeps `import speclab.config` etc. from importing torch/transformers
    if name in ("Decoder", "generate", "GenerationResult"):
        from speclab import api

        return getattr(api, name)
    raise AttributeError(name)
