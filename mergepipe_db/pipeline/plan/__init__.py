"""Planning: choose the access set within the budget (`build`), or take it from a manifest (`from_manifest`)."""
