"""The figures' two halves: data.py turns runs into rows (no matplotlib, so make_posts.py --check recomputes every
CSV), draw.py turns rows into a PNG. Which runs each figure of the series is made from: make_plots.py's FIGURES."""
