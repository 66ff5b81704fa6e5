package allocator

// Checkpoints of private pools, for torch.compile's CUDA graph trees.
//
// A tree records one graph after another into one pool. After replaying a
// path of graphs it may record a new graph that branches off; the pool
// must then look as it did when the path's last graph was recorded, with
// the blocks of the tensors still live allocated at their addresses and
// the rest free, so that the new recording neither overwrites a live
// tensor nor wastes the dead ones' memory. PyTorch's allocator takes a
// checkpoint of the pool after each recording (getCheckpointState) and
// sets the pool back to it (setCheckpointPoolState); these are the same.

import (
	"errors"
	"fmt"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
)

// PoolCheckpoint is a private pool's layout at one moment: its segments,
// each as its blocks in address order. It is immutable.
type PoolCheckpoint struct {
	id   PoolID
	segs []checkpointSegment
}

type checkpointSegment struct {
	ptr, size uint64
	blocks    []checkpointBlock
}

type checkpointBlock struct {
	ptr, size, requested uint64
	allocated, unmapped  bool
}

// ID returns the pool the checkpoint is of.
func (ck *PoolCheckpoint) ID() PoolID { return ck.id }

// Allocated returns the addresses of the blocks allocated at the
// checkpoint, in address order within each segment.
func (ck *PoolCheckpoint) Allocated() []cudart.Ptr {
	var out []cudart.Ptr
	for _, s := range ck.segs {
		for _, b := range s.blocks {
			if b.allocated {
				out = append(out, cudart.Ptr(b.ptr))
			}
		}
	}
	return out
}

// CheckpointPool records the layout of pool id, which must have a user
// (PyTorch's getCheckpointState). Blocks waiting for events count as
// allocated.
func (a *Allocator) CheckpointPool(id PoolID) (*PoolCheckpoint, error) {
	a.lockWorld()
	defer a.unlockWorld()
	if err := a.poolCallOK("checkpoint pool", id); err != nil {
		return nil, err
	}
	p := a.private[id]
	if p == nil || p.uses == 0 {
		return nil, fmt.Errorf("allocator: checkpoint pool %v: it has no user: %w", id, ErrUnknownPool)
	}
	ck := &PoolCheckpoint{id: id}
	for _, s := range a.segs.list {
		if a.privateSeq[blocks.PoolSeq(s.Stream)] != p {
			continue
		}
		cs := checkpointSegment{ptr: s.Ptr, size: s.Size}
		for b := s.Head; b != nil; b = b.Next {
			cs.blocks = append(cs.blocks, checkpointBlock{ptr: b.Ptr, size: b.Size, requested: b.Requested,
				allocated: b.Allocated || b.EventCount > 0, unmapped: b.Unmapped})
		}
		ck.segs = append(ck.segs, cs)
	}
	return ck, nil
}

// ErrCheckpointMismatch: RestorePool found the pool in a state the
// checkpoint cannot be restored from.
var ErrCheckpointMismatch = errors.New("pool does not match the checkpoint")

// RestorePool sets ck's pool back to ck (PyTorch's setCheckpointPoolState):
// it frees every block allocated in the pool now, then allocates the
// blocks that were allocated at the checkpoint, at their addresses and
// sizes, and leaves the rest of each of the checkpoint's segments free as
// it was split then. Segments made since the checkpoint stay, free. It
// returns the addresses it freed and those it allocated; the caller owns
// the latter as if Malloc had returned them (torch hands them to the
// tensors still live).
//
// It fails, changing nothing, when the pool has no user, a capture is
// under way, a block of the pool waits for events or was used by another
// stream, or a segment of the checkpoint is gone or changed size. It
// fails with ErrCheckpointMismatch, having freed the pool's blocks and
// allocated what it could, when the free segments cannot be split as the
// checkpoint says (which a pool that only grew since cannot cause).
func (a *Allocator) RestorePool(ck *PoolCheckpoint) (freed, allocated []cudart.Ptr, err error) {
	a.lockWorld()
	defer a.unlockWorld()
	id := ck.id
	if err := a.poolCallOK("restore pool", id); err != nil {
		return nil, nil, err
	}
	p := a.private[id]
	switch {
	case p == nil || p.uses == 0:
		return nil, nil, fmt.Errorf("allocator: restore pool %v: it has no user: %w", id, ErrUnknownPool)
	case a.capturing > 0:
		return nil, nil, fmt.Errorf("allocator: restore pool %v: %w", id, ErrCaptureUnderway)
	}
	// Check first what can be checked without changing anything.
	segs := make([]*blocks.Segment, len(ck.segs))
	for i, cs := range ck.segs {
		for _, s := range a.segs.list {
			if s.Ptr == cs.ptr && a.privateSeq[blocks.PoolSeq(s.Stream)] == p {
				segs[i] = s
				break
			}
		}
		if segs[i] == nil || segs[i].Size != cs.size {
			return nil, nil, fmt.Errorf("allocator: restore pool %v: segment %#x (%d bytes) of the checkpoint is gone or resized: %w", id, cs.ptr, cs.size, ErrCheckpointMismatch)
		}
	}
	var live []*blocks.Block
	for _, s := range a.segs.list {
		if a.privateSeq[blocks.PoolSeq(s.Stream)] != p {
			continue
		}
		for b := s.Head; b != nil; b = b.Next {
			if b.EventCount > 0 || (b.Allocated && len(b.StreamUses) > 0) {
				return nil, nil, fmt.Errorf("allocator: restore pool %v: block %#x waits for or was used by another stream: %w", id, b.Ptr, ErrCheckpointMismatch)
			}
			if b.Allocated {
				live = append(live, b)
			}
		}
	}
	// Free the pool's blocks. Merging absorbs only free neighbours, so
	// the blocks still to free stay valid.
	for _, b := range live {
		pl := a.poolOf(b)
		freed = append(freed, cudart.Ptr(b.Ptr))
		pl.sh.active.del(b.Ptr)
		a.release(pl, b)
		a.record(nil, actionFreeRequested, b.Ptr, b.Requested, cudart.Stream(b.Segment.Stream))
		a.freeBlock(nil, pl, b)
	}
	// Carve each checkpointed segment as it was: allocate every mapped
	// block in order, then free those that were free.
	for i, cs := range ck.segs {
		var carved []*blocks.Block
		cur := segs[i].Head
		for _, kb := range cs.blocks {
			if kb.unmapped {
				// What lies past the checkpoint's mapped blocks stays:
				// unmapped then, perhaps mapped (and free) now.
				break
			}
			if cur == nil || cur.Ptr != kb.ptr || !cur.Free() || cur.Unmapped || cur.Size < kb.size {
				err = fmt.Errorf("allocator: restore pool %v: no free block for the checkpoint's %#x (%d bytes) in segment %#x: %w", id, kb.ptr, kb.size, cs.ptr, ErrCheckpointMismatch)
				break
			}
			pl := a.poolOf(cur)
			var d delta
			mallocDelta(&d, cur.Segment.Expandable, cur.IsSplit(), kb.size < cur.Size, cur.Size, kb.size, kb.requested, a.cfg.MaxSplitSize)
			pl.free.Delete(cur)
			a.allocFoundBlock(nil, pl, cur, &d)
			carved = append(carved, cur)
			cur = cur.Next
		}
		for j, b := range carved {
			if cs.blocks[j].allocated {
				allocated = append(allocated, cudart.Ptr(b.Ptr))
				continue
			}
			pl := a.poolOf(b)
			pl.sh.active.del(b.Ptr)
			a.release(pl, b)
			a.freeBlock(nil, pl, b)
		}
		if err != nil {
			return freed, allocated, err
		}
	}
	return freed, allocated, nil
}
