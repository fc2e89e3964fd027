"""The daemon's paged memory bookkeeping (torch-free): the page allocator and adapter
residency. The page geometry both sides share is loraplex.contracts.geometry."""
