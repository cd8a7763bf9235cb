"""The one place that touches private names of Lightning, torch and Triton.

Where a framework's public surface has no way to do what the project needs, the private name is used here, behind
a function or a small base class with a public name, and ``tests/compat`` holds a test for each that fails, naming
the release that broke it, when a new version moves the name. Nothing else in the project uses a private name of
these libraries (``tests/compat/test_private_names.py`` reads the sources to keep it so).

``lightning`` needs Lightning; ``torch`` and ``triton`` do not, so the model, the kernels and
``lm_systems.parallel`` stay usable without it.
"""
