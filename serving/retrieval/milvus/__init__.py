"""Knowledge bases served by Milvus (a server or Milvus Lite): the retriever
(:mod:`specops.serving.retrieval.milvus.kb`), the collection build (``build``) and the
service process (``service``)."""
