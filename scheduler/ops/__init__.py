"""The operator's view of the pool: its figures (figures.py, pure arithmetic on plain data), read
from the database (snapshot.py), shown at /ops/ (views.py, urls.py) and exported to Prometheus at
/metrics (prom.py)."""
