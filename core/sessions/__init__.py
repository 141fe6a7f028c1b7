"""Past sessions: the n-gram index of token documents (``ngram``), what a cluster keeps of its past
outputs (``cache``) and the ``sessions-<cluster>`` artifact on disk (``store``)."""
