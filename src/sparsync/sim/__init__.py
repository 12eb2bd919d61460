"""Simulators: alpha-beta collectives (formulas + executed thread simulation) and MG-WFBP schedules."""
