"""The global view: every program computes as on one device. The DTensor function mode and its op handlers, the
annotations as layouts, the wrapped modules' boundary, and the analyses that prove where a process may compute on
its own rows."""
