from smol import smol, smol_doc  # noqa: F401  (session fixtures of the real model, registered once here)
