"""Triton kernels. Only launchers (``na3d/ops``) import from here."""
