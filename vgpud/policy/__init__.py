"""Upcall to verdict (sans-I/O): the policy interface, the dispatcher, the policies, the rules."""
