"""kNN-LM, plain and speculative: decoding (:mod:`specops.serving.ralm.knnlm.decode`), the
datastore build (``store``) and its neighbour search (``search``)."""
