// simdev: a compiled PrivateUse1 test device. Its memory is host memory behind its own
// allocator (counted, resizable in place: FSDP2 frees and refills parameter storage), its
// views are PyTorch's native view kernels, every other op runs through PyTorch's CPU fallback
// (inputs copied to the CPU, results copied back), every op is synchronous (so streams and
// events are trivially ordered), and its process-group backend runs gloo on CPU aliases of
// its tensors. It exists to run torchspmd on a device that is neither the CPU nor CUDA.
#include <torch/extension.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_set>

namespace simdev {

constexpr c10::DeviceIndex kDevices = 8;
thread_local c10::DeviceIndex current_device = 0;
thread_local int64_t current_stream = 0;

// ---- memory ------------------------------------------------------------------------------
struct Block {
  void* data;
  size_t size;
  c10::DeviceIndex device;
};

struct Counts {
  std::mutex lock;
  int64_t current[kDevices] = {};
  int64_t peak[kDevices] = {};
  void add(c10::DeviceIndex d, int64_t n) {
    std::lock_guard<std::mutex> g(lock);
    current[d] += n;
    if (current[d] > peak[d]) peak[d] = current[d];
  }
};
Counts counts;

void release(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  counts.add(block->device, -static_cast<int64_t>(block->size));
  c10::free_cpu(block->data);
  delete block;
}

struct Allocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    auto device = current_device;
    void* data = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    auto* block = new Block{data, nbytes, device};
    counts.add(device, static_cast<int64_t>(nbytes));
    return {data, block, &release, c10::Device(c10::DeviceType::PrivateUse1, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, size_t count) const override { std::memcpy(dest, src, count); }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}
  void recordStream(const c10::DataPtr&, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    c10::CachingDeviceAllocator::DeviceStats stats;
    std::lock_guard<std::mutex> g(counts.lock);
    for (auto* array : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
                        &stats.requested_bytes}) {
      auto& stat = (*array)[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
      stat.current = counts.current[device];
      stat.peak = counts.peak[device];
    }
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex) override {}
  void resetPeakStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> g(counts.lock);
    counts.peak[device] = counts.current[device];
  }
};
Allocator allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &allocator);

// Page-locked host memory, as a device's host allocator gives it: here plain host memory,
// remembered so that is_pinned() answers true for it.
std::mutex pinned_lock;
std::unordered_set<void*> pinned;

void release_pinned(void* data) {
  {
    std::lock_guard<std::mutex> g(pinned_lock);
    pinned.erase(data);
  }
  c10::free_cpu(data);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    if (data) {
      std::lock_guard<std::mutex> g(pinned_lock);
      pinned.insert(data);
    }
    return {data, data, &release_pinned, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release_pinned; }
  void copy_data(void* dest, const void* src, size_t count) const override { std::memcpy(dest, src, count); }
};
PinnedAllocator pinned_allocator;

// ---- device guard: one queue per device, every op already finished when it returns -------
char recorded_event;

struct Guard final : c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {kType, current_device}; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.index() >= 0 && d.index() < kDevices, "simdev: no device ", int(d.index()));
    current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_device = d.index(); }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, current_stream);
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  c10::Stream getNewStream(c10::Device d, int) const override {
    static std::atomic<int64_t> next{1};
    return c10::Stream(c10::Stream::UNSAFE, d, next++);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto old = getStream(s.device());
    current_stream = s.id();
    return old;
  }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    *event = &recorded_event;
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  c10::DeviceIndex deviceCount() const noexcept override { return kDevices; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// ---- hooks: availability, generators, storage resize ------------------------------------
struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device) const override {
    static std::vector<at::Generator> generators = [] {
      std::vector<at::Generator> made;
      for (int i = 0; i < kDevices; ++i) made.push_back(at::make_generator<at::CPUGeneratorImpl>(67280421310721 + i));
      return made;
    }();
    return generators.at(device < 0 ? current_device : device);
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override { return at::make_generator<at::CPUGeneratorImpl>(); }
  at::Device getDeviceFromPtr(void*) const override { return {c10::DeviceType::PrivateUse1, current_device}; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> g(pinned_lock);
    return pinned.count(const_cast<void*>(data)) > 0;
  }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  c10::DeviceIndex deviceCount() const override { return kDevices; }
  void setCurrentDevice(c10::DeviceIndex d) const override { current_device = d; }
  c10::DeviceIndex getCurrentDevice() const override { return current_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = current_device;
    current_device = d;
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);
  }
};
Hooks hooks;
struct RegisterHooks {
  RegisterHooks() { at::RegisterPrivateUse1HooksInterface(&hooks); }
} register_hooks;

// ---- kernels ------------------------------------------------------------------------------
// A CPU tensor over the same memory (alive as long as the storage it aliases).
at::Tensor host(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != c10::DeviceType::PrivateUse1) return t;
  c10::Storage storage = t.storage();
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [storage](void*) {},
                       t.options().device(c10::Device(c10::kCPU)));
}

at::Tensor empty(c10::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                 std::optional<at::Device> device, std::optional<bool> pin,
                 std::optional<at::MemoryFormat> memory_format) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_generic(size, &allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<at::Device> device,
                         std::optional<bool> pin) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_strided_generic(size, stride, &allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  host(dst).copy_(host(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes());
  host(dst).copy_(host(self));
  return dst;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, source, offset, size, stride);
}

void record_stream(at::Tensor&, c10::Stream) {}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) { at::native::cpu_fallback(op, stack); }

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("resize_", at::native::resize_);
  m.impl("set_.source_Storage", at::native::set_);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("record_stream", record_stream);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

// ---- process-group backend: gloo on CPU aliases -------------------------------------------
std::vector<at::Tensor> hosts(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(host(t));
  return out;
}
std::vector<std::vector<at::Tensor>> hosts(const std::vector<std::vector<at::Tensor>>& ts) {
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& t : ts) out.push_back(hosts(t));
  return out;
}

// gloo has no AVG: SUM, then divide by the group's size once the sum is there.
template <typename Options>
bool averaged(Options& opts) {
  if (opts.reduceOp != c10d::ReduceOp::AVG) return false;
  opts.reduceOp = c10d::ReduceOp::SUM;
  return true;
}

class Backend final : public c10d::Backend {
 public:
  explicit Backend(c10::intrusive_ptr<c10d::Backend> inner)
      : c10d::Backend(inner->getRank(), inner->getSize()), inner_(std::move(inner)) {}

  const std::string getBackendName() const override { return "simgloo"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override {
    auto h = hosts(t);
    return inner_->broadcast(h, o);
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    auto h = hosts(t);
    auto opts = o;
    if (!averaged(opts)) return inner_->allreduce(h, opts);
    auto work = inner_->allreduce(h, opts);
    work->wait();
    for (auto& x : h) x.div_(getSize());
    return work;
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& t,
                                                     const c10d::AllreduceCoalescedOptions& o) override {
    auto h = hosts(t);
    auto opts = o;
    if (!averaged(opts)) return inner_->allreduce_coalesced(h, opts);
    auto work = inner_->allreduce_coalesced(h, opts);
    work->wait();
    for (auto& x : h) x.div_(getSize());
    return work;
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override {
    auto h = hosts(t);
    return inner_->reduce(h, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                           const c10d::AllgatherOptions& o) override {
    auto ho = hosts(out);
    auto hi = hosts(in);
    return inner_->allgather(ho, hi, o);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override {
    auto ho = host(out);
    auto hi = host(in);
    return inner_->_allgather_base(ho, hi, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                 std::vector<at::Tensor>& in,
                                                                 const c10d::AllgatherOptions& o) override {
    auto ho = hosts(out);
    auto hi = hosts(in);
    return inner_->allgather_into_tensor_coalesced(ho, hi, o);
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                        const c10d::GatherOptions& o) override {
    auto ho = hosts(out);
    auto hi = hosts(in);
    return inner_->gather(ho, hi, o);
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                         const c10d::ScatterOptions& o) override {
    auto ho = hosts(out);
    auto hi = hosts(in);
    return inner_->scatter(ho, hi, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& out,
                                                std::vector<std::vector<at::Tensor>>& in,
                                                const c10d::ReduceScatterOptions& o) override {
    auto ho = hosts(out);
    auto hi = hosts(in);
    auto opts = o;
    if (!averaged(opts)) return inner_->reduce_scatter(ho, hi, opts);
    auto work = inner_->reduce_scatter(ho, hi, opts);
    work->wait();
    for (auto& x : ho) x.div_(getSize());
    return work;
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& o) override {
    auto ho = host(out);
    auto hi = host(in);
    auto opts = o;
    if (!averaged(opts)) return inner_->_reduce_scatter_base(ho, hi, opts);
    auto work = inner_->_reduce_scatter_base(ho, hi, opts);
    work->wait();
    ho.div_(getSize());
    return work;
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                 std::vector<at::Tensor>& in,
                                                                 const c10d::ReduceScatterOptions& o) override {
    auto ho = hosts(out);
    auto hi = hosts(in);
    auto opts = o;
    if (!averaged(opts)) return inner_->reduce_scatter_tensor_coalesced(ho, hi, opts);
    auto work = inner_->reduce_scatter_tensor_coalesced(ho, hi, opts);
    work->wait();
    for (auto& x : ho) x.div_(getSize());
    return work;
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& o) override {
    auto ho = host(out);
    auto hi = host(in);
    return inner_->alltoall_base(ho, hi, out_splits, in_splits, o);
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::AllToAllOptions& o) override {
    auto ho = hosts(out);
    auto hi = hosts(in);
    return inner_->alltoall(ho, hi, o);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    auto h = hosts(t);
    return inner_->send(h, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int src, int tag) override {
    auto h = hosts(t);
    return inner_->recv(h, src, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& t, int tag) override {
    auto h = hosts(t);
    return inner_->recvAnysource(h, tag);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override {
    auto opts = o;
    opts.device = c10::Device(c10::kCPU);
    return inner_->barrier(opts);
  }

 private:
  c10::intrusive_ptr<c10d::Backend> inner_;
};

c10::intrusive_ptr<c10d::Backend> wrap(const c10::intrusive_ptr<c10d::Backend>& inner) {
  return c10::make_intrusive<Backend>(inner);
}

std::tuple<int64_t, int64_t> memory(int64_t device) {
  std::lock_guard<std::mutex> g(counts.lock);
  return {counts.current[device], counts.peak[device]};
}

}  // namespace simdev

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<simdev::Backend, c10d::Backend, c10::intrusive_ptr<simdev::Backend>>(m, "Backend");
  m.def("wrap", &simdev::wrap, "the simdev process-group backend over a gloo backend");
  m.def("host", &simdev::host, "a CPU tensor over a simdev tensor's memory");
  m.def("device_count", [] { return int(simdev::kDevices); });
  m.def("memory", &simdev::memory, "(bytes allocated now, peak) on a simdev device");
}
