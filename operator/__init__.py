"""Kubernetes operator for DynaTrainJob (kopf handlers arrive with the operator issue).

Imported as ``dynatrain.operator``. The folder is called ``operator`` at the repository root
because our users asked for that layout; it never shadows the standard library's ``operator``
because the interpreter imports that one at start-up, before the working directory is searched
(tests/test_packaging.py checks this).
"""
