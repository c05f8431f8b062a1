"""Upstream libraries behind one seam: the patch machinery and, per library, the adapter that
alone touches its internals."""
