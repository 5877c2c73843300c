"""``feedline report``: a run as a self-contained HTML page, drawn from the dashboard's own panel queries."""
