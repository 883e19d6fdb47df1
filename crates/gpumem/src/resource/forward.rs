//! Forwarding macros for resources that wrap another one (adaptors, the allocator, the CUDA
//! resources over their shared stream operations).

/// Implement [`crate::resource::StreamOps`] for `$ty` by forwarding to the backend `$inner`
/// (an expression over `self` that yields something implementing `StreamOps`).
macro_rules! forward_stream_ops {
    ($ty:ty, |$s:ident| $inner:expr) => {
        impl $crate::resource::StreamOps for $ty {
            fn record_event(
                &self,
                stream: $crate::resource::Stream,
            ) -> $crate::error::Result<$crate::resource::Event> {
                let $s = self;
                $inner.record_event(stream)
            }
            fn event_done(&self, event: $crate::resource::Event) -> $crate::error::Result<bool> {
                let $s = self;
                $inner.event_done(event)
            }
            fn sync_event(&self, event: $crate::resource::Event) -> $crate::error::Result<()> {
                let $s = self;
                $inner.sync_event(event)
            }
            fn wait_event(
                &self,
                stream: $crate::resource::Stream,
                event: $crate::resource::Event,
            ) -> $crate::error::Result<()> {
                let $s = self;
                $inner.wait_event(stream, event)
            }
            fn destroy_event(&self, event: $crate::resource::Event) {
                let $s = self;
                $inner.destroy_event(event)
            }
            fn create_stream(&self) -> $crate::error::Result<$crate::resource::Stream> {
                let $s = self;
                $inner.create_stream()
            }
            fn destroy_stream(&self, stream: $crate::resource::Stream) {
                let $s = self;
                $inner.destroy_stream(stream)
            }
            fn synchronize(&self, stream: $crate::resource::Stream) -> $crate::error::Result<()> {
                let $s = self;
                $inner.synchronize(stream)
            }
            fn synchronize_device(&self) -> $crate::error::Result<()> {
                let $s = self;
                $inner.synchronize_device()
            }
            fn is_capturing(&self, stream: $crate::resource::Stream) -> bool {
                let $s = self;
                $inner.is_capturing(stream)
            }
            fn capture_frontier(&self, stream: $crate::resource::Stream) -> Option<Vec<u64>> {
                let $s = self;
                $inner.capture_frontier(stream)
            }
            fn capture_follows(&self, stream: $crate::resource::Stream, nodes: &[u64]) -> bool {
                let $s = self;
                $inner.capture_follows(stream, nodes)
            }
            unsafe fn copy(
                &self,
                dst: $crate::resource::DevPtr,
                src: $crate::resource::DevPtr,
                bytes: usize,
                kind: $crate::resource::CopyKind,
                stream: $crate::resource::Stream,
            ) -> $crate::error::Result<()> {
                let $s = self;
                // SAFETY: forwarded under the caller's guarantees (trait contract).
                unsafe { $inner.copy(dst, src, bytes, kind, stream) }
            }
            unsafe fn memset(
                &self,
                dst: $crate::resource::DevPtr,
                value: u8,
                bytes: usize,
                stream: $crate::resource::Stream,
            ) -> $crate::error::Result<()> {
                let $s = self;
                // SAFETY: forwarded under the caller's guarantees (trait contract).
                unsafe { $inner.memset(dst, value, bytes, stream) }
            }
        }
    };
}
pub(crate) use forward_stream_ops;

/// Inside an `impl Resource` of a wrapper: forward the capabilities a wrapper passes through
/// unchanged (peer access, host registration) to `self.$inner`.
macro_rules! forward_resource_passthrough {
    ($inner:ident) => {
        fn peer_access(&self) -> Option<&dyn $crate::resource::PeerAccess> {
            self.$inner.peer_access()
        }
        fn host_registration(&self) -> Option<&dyn $crate::resource::HostRegistration> {
            self.$inner.host_registration()
        }
        fn ipc(&self) -> Option<&dyn $crate::resource::Ipc> {
            self.$inner.ipc()
        }
    };
}
pub(crate) use forward_resource_passthrough;
