"""Planning before renting: a strategy's memory and collectives per rank, on a simulated world."""
