"""What a benchmark or a simulation plays and how it is measured: sessions (synthetic or from
traces), loads, request records, SLO goodput and reports. Torch-free; ``bench`` plays them
against real endpoints and ``sim`` against simulated ones, so both print the same summary
from the same records."""
