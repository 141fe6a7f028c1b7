"""``specops demo``: the stack it starts (:mod:`specops.demo.stack`), the traffic it sends
(:mod:`specops.demo.traffic`), and the report it writes (:mod:`specops.demo.report.page`)."""
