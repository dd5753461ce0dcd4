"""Plugin modules of the test tree: code outside the ``speclab`` package that adds to its
registries when named in ``$SPECLAB_PLUGINS`` (:mod:`speclab.plugins`).

* :mod:`tests.plugins.mlp_speculator`: a whole trained drafter family (an MLP speculator:
  method, drafter, model, objectives, Ray Train task, artifact check, Tune trial kind)
  with no edit to the package.
"""
