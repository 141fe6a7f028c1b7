"""The demo's report: the rows and numbers it is made of (:mod:`specops.demo.report.data`), its
plots (``plots``) and the HTML page and JSON it writes (``page``)."""
