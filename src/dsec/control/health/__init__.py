"""Fleet health (after TRANSOM's TEE and TOL): what each edge reports about itself, the
detector that scores edges against their peers and their own history, the fleet events
every health change, cordon, drain and move leaves behind."""
