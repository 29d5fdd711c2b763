"""archspec: a declarative architecture-search toolkit for linear-RNN sequence mixers."""
