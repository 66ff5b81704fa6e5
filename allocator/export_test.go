package allocator

// WithoutLending makes the out-of-memory path of expandable segments lend
// nothing, as before loans (expandable.go), for tests that compare the two.
var WithoutLending Option = func(o *options) { o.noLend = true }

// WithoutGrowthRounding makes the default reclaim policy map what each
// growth needs, without rounding it to the 20 MiB page boundary
// (vmm.Config.Exact), for the tests whose arithmetic is about reclaim
// alone.
var WithoutGrowthRounding Option = func(o *options) { o.exactGrowth = true }

// WithoutParking makes every shard free as PyTorch does, straight into
// the free index, with no front cache (front.go), for tests that compare
// the two.
var WithoutParking Option = func(o *options) { o.noPark = true }

// WithoutHotSmallFromLarge makes small requests at the limit of
// expandable segments take the large pool's blocks in world mode only, as
// before the hot path took them (smallFromLargeHot), for tests that
// compare the two.
var WithoutHotSmallFromLarge Option = func(o *options) { o.slowFromLarge = true }
