package deploy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8slabels "k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"
)

// ---- documents and strict decoding ----

var docSeparator = regexp.MustCompile(`(?m)^---[ \t]*$`)

// readDocs returns the YAML documents of file, split on "---" lines,
// leaving out those that hold nothing but comments.
func readDocs(t *testing.T, file string) [][]byte {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var docs [][]byte
	for _, d := range docSeparator.Split(string(b), -1) {
		j, err := yaml.YAMLToJSON([]byte(d))
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		if string(j) != "null" {
			docs = append(docs, []byte(d))
		}
	}
	return docs
}

// decodeStrict decodes a YAML document into v; a field v has no place for,
// or a key given twice, is an error.
func decodeStrict(doc []byte, v any) error {
	return yaml.UnmarshalStrict(doc, v)
}

// manifests are the objects of deploy/kubernetes.
type manifests struct {
	namespaces []corev1.Namespace
	configMaps []corev1.ConfigMap
	daemonSets []appsv1.DaemonSet
	pods       []corev1.Pod
}

func loadManifests(t *testing.T) *manifests {
	t.Helper()
	files, err := filepath.Glob(filepath.Join("kubernetes", "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no manifest in kubernetes/")
	}
	m := &manifests{}
	for _, file := range files {
		for i, doc := range readDocs(t, file) {
			where := fmt.Sprintf("%s, document %d", file, i+1)
			var tm metav1.TypeMeta
			if err := yaml.Unmarshal(doc, &tm); err != nil {
				t.Fatalf("%s: %v", where, err)
			}
			var err error
			switch tm.APIVersion + " " + tm.Kind {
			case "v1 Namespace":
				var o corev1.Namespace
				err = decodeStrict(doc, &o)
				m.namespaces = append(m.namespaces, o)
			case "v1 ConfigMap":
				var o corev1.ConfigMap
				err = decodeStrict(doc, &o)
				m.configMaps = append(m.configMaps, o)
			case "apps/v1 DaemonSet":
				var o appsv1.DaemonSet
				err = decodeStrict(doc, &o)
				m.daemonSets = append(m.daemonSets, o)
			case "v1 Pod":
				var o corev1.Pod
				err = decodeStrict(doc, &o)
				m.pods = append(m.pods, o)
			default:
				err = fmt.Errorf("kind %q of %q: the test knows no such object", tm.Kind, tm.APIVersion)
			}
			if err != nil {
				t.Fatalf("%s: %v", where, err)
			}
		}
	}
	if len(m.namespaces) != 1 || len(m.configMaps) != 1 || len(m.daemonSets) != 1 || len(m.pods) != 1 {
		t.Fatalf("want one Namespace, ConfigMap, DaemonSet and Pod; got %d, %d, %d, %d",
			len(m.namespaces), len(m.configMaps), len(m.daemonSets), len(m.pods))
	}
	return m
}

// broker returns the DaemonSet's broker container.
func (m *manifests) broker(t *testing.T) *corev1.Container {
	t.Helper()
	cs := m.daemonSets[0].Spec.Template.Spec.Containers
	if len(cs) != 1 {
		t.Fatalf("the DaemonSet has %d containers, want 1", len(cs))
	}
	return &cs[0]
}

// job returns the example pod's one container.
func (m *manifests) job(t *testing.T) *corev1.Container {
	t.Helper()
	cs := m.pods[0].Spec.Containers
	if len(cs) != 1 {
		t.Fatalf("the example pod has %d containers, want 1", len(cs))
	}
	return &cs[0]
}

// flags returns the broker's command-line flags: "--name=value" or
// "--name value", a flag without a value as "true".
func flags(t *testing.T, args []string) map[string]string {
	t.Helper()
	if len(args) == 0 || args[0] != "serve" {
		t.Fatalf("args %q: want the serve command first", args)
	}
	f := map[string]string{}
	for i := 1; i < len(args); i++ {
		a, ok := strings.CutPrefix(args[i], "--")
		if !ok {
			t.Fatalf("args %q: %q is no flag", args, args[i])
		}
		name, value, ok := strings.Cut(a, "=")
		if !ok {
			value = "true"
			if i+1 < len(args) && !strings.HasPrefix(args[i+1], "--") {
				value = args[i+1]
				i++
			}
		}
		if _, dup := f[name]; dup {
			t.Errorf("flag --%s given twice", name)
		}
		f[name] = value
	}
	return f
}

func port(t *testing.T, c *corev1.Container, name string) corev1.ContainerPort {
	t.Helper()
	for _, p := range c.Ports {
		if p.Name == name {
			return p
		}
	}
	t.Fatalf("container %s has no port named %q", c.Name, name)
	return corev1.ContainerPort{}
}

func env(c *corev1.Container, name string) (string, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value, true
		}
	}
	return "", false
}

// mountOf returns the volume mounted at the directory dir in c, and the
// mount.
func mountOf(t *testing.T, spec *corev1.PodSpec, c *corev1.Container, dir string) (corev1.Volume, corev1.VolumeMount) {
	t.Helper()
	for _, vm := range c.VolumeMounts {
		if filepath.Clean(vm.MountPath) == filepath.Clean(dir) {
			for _, v := range spec.Volumes {
				if v.Name == vm.Name {
					return v, vm
				}
			}
			t.Fatalf("container %s mounts volume %q, which the pod does not have", c.Name, vm.Name)
		}
	}
	t.Fatalf("container %s mounts nothing at %s", c.Name, dir)
	return corev1.Volume{}, corev1.VolumeMount{}
}

func TestStrictDecodingRefusesUnknownFields(t *testing.T) {
	doc := []byte("apiVersion: v1\nkind: Pod\nmetadata:\n  name: x\nspec:\n  containers:\n    - name: c\n      image: i\n      imagePullPolcy: Always\n")
	if err := decodeStrict(doc, &corev1.Pod{}); err == nil {
		t.Fatal("a misspelt field decoded without error")
	}
	dup := []byte("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: a\n  name: b\n")
	if err := decodeStrict(dup, &corev1.Namespace{}); err == nil {
		t.Fatal("a key given twice decoded without error")
	}
}

func TestBrokerDaemonSet(t *testing.T) {
	m := loadManifests(t)
	ds := &m.daemonSets[0]
	spec := &ds.Spec.Template.Spec
	c := m.broker(t)
	ns := m.namespaces[0].Name
	if ds.Namespace != ns || m.configMaps[0].Namespace != ns {
		t.Errorf("DaemonSet in %q, ConfigMap in %q; the Namespace is %q", ds.Namespace, m.configMaps[0].Namespace, ns)
	}
	sel, err := metav1.LabelSelectorAsSelector(ds.Spec.Selector)
	if err != nil {
		t.Fatal(err)
	}
	if !sel.Matches(k8slabels.Set(ds.Spec.Template.Labels)) {
		t.Errorf("the DaemonSet's selector %s does not match its pods' labels %v", sel, ds.Spec.Template.Labels)
	}
	if spec.NodeSelector["nvidia.com/gpu.present"] != "true" {
		t.Errorf("nodeSelector %v: want nvidia.com/gpu.present: \"true\"", spec.NodeSelector)
	}
	if !slices.ContainsFunc(spec.Tolerations, func(tl corev1.Toleration) bool {
		return tl.Key == "nvidia.com/gpu" && tl.Operator == corev1.TolerationOpExists
	}) {
		t.Errorf("no toleration of nvidia.com/gpu: %v", spec.Tolerations)
	}
	if spec.RuntimeClassName == nil || *spec.RuntimeClassName != "nvidia" {
		t.Error("runtimeClassName is not nvidia")
	}
	if v, _ := env(c, "NVIDIA_VISIBLE_DEVICES"); v != "all" {
		t.Errorf("NVIDIA_VISIBLE_DEVICES=%q, want all", v)
	}
	if c.Image != "ghcr.io/allocd/allocd:latest" {
		t.Errorf("image %q", c.Image)
	}

	f := flags(t, c.Args)
	for name, want := range map[string]string{"broker": "true", "device": "cuda:all", "broker-socket-mode": "0660"} {
		if f[name] != want {
			t.Errorf("--%s=%q, want %q", name, f[name], want)
		}
	}

	// The metrics port: --listen, the port named metrics, the probes.
	_, listenPort, err := splitHostPort(f["listen"])
	if err != nil {
		t.Fatalf("--listen: %v", err)
	}
	if p := port(t, c, "metrics"); p.ContainerPort != listenPort {
		t.Errorf("port metrics is %d, --listen says %d", p.ContainerPort, listenPort)
	}
	for _, pr := range []struct {
		name  string
		probe *corev1.Probe
		path  string
	}{{"liveness", c.LivenessProbe, "/healthz"}, {"readiness", c.ReadinessProbe, "/readyz"}, {"startup", c.StartupProbe, "/healthz"}} {
		switch {
		case pr.probe == nil || pr.probe.HTTPGet == nil:
			t.Errorf("no HTTP %s probe", pr.name)
		case pr.probe.HTTPGet.Path != pr.path || pr.probe.HTTPGet.Port.String() != "metrics":
			t.Errorf("%s probe: GET %s on port %s, want %s on metrics", pr.name, pr.probe.HTTPGet.Path, pr.probe.HTTPGet.Port.String(), pr.path)
		}
	}

	// The socket: in a hostPath directory the broker creates.
	sock := f["broker-socket"]
	v, vm := mountOf(t, spec, c, filepath.Dir(sock))
	if v.HostPath == nil || v.HostPath.Type == nil || *v.HostPath.Type != corev1.HostPathDirectoryOrCreate {
		t.Errorf("volume %q: want a hostPath of type DirectoryOrCreate", v.Name)
	} else if v.HostPath.Path != vm.MountPath {
		t.Errorf("hostPath %s mounted at %s: jobs mount the host's directory at the same path, so the two should agree", v.HostPath.Path, vm.MountPath)
	}
	if vm.ReadOnly {
		t.Error("the socket directory is mounted read-only")
	}

	// The tenants file: from the ConfigMap.
	tenants := f["broker-tenants"]
	v, vm = mountOf(t, spec, c, filepath.Dir(tenants))
	cm := &m.configMaps[0]
	switch {
	case v.ConfigMap == nil || v.ConfigMap.Name != cm.Name:
		t.Errorf("%s: volume %q is not the ConfigMap %s", tenants, v.Name, cm.Name)
	case !vm.ReadOnly:
		t.Errorf("the tenants file is mounted read-write")
	default:
		key := filepath.Base(tenants)
		for _, it := range v.ConfigMap.Items {
			if it.Path == key {
				key = it.Key
			}
		}
		if _, ok := cm.Data[key]; !ok {
			t.Errorf("%s: the ConfigMap %s has no key %q", tenants, cm.Name, key)
		}
	}

	// SIGTERM: the kubelet waits longer than the broker.
	stop, err := time.ParseDuration(f["broker-stop-timeout"])
	if err != nil {
		t.Fatalf("--broker-stop-timeout: %v", err)
	}
	if g := spec.TerminationGracePeriodSeconds; g == nil || time.Duration(*g)*time.Second <= stop {
		t.Errorf("terminationGracePeriodSeconds must exceed --broker-stop-timeout=%s", stop)
	}

	// Requests, and as little privilege as the GPU allows.
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() {
		t.Error("the broker requests no CPU or no memory")
	}
	if c.Resources.Limits.Memory().IsZero() {
		t.Error("the broker has no memory limit")
	}
	checkRestricted(t, "broker", spec.SecurityContext, c.SecurityContext, true)
	// The host's pid namespace only: SO_PEERCRED gives the broker its
	// clients' pids as its own namespace sees them, and it waits on them.
	if spec.HostNetwork || spec.HostIPC {
		t.Error("the broker shares the host's network or IPC namespace")
	}
	if !spec.HostPID {
		t.Error("the broker is not in the host's pid namespace: it cannot see the pids of clients in other pods")
	}

	if socketGroup(t, m) < 0 {
		t.Error("the socket has no group of its own: its mode lets the group in")
	}
}

// socketGroup returns the gid the broker's socket gets: that of
// --broker-socket-group, which must then be numeric, or else the
// broker's runAsGroup; -1 for neither.
func socketGroup(t *testing.T, m *manifests) int64 {
	t.Helper()
	if g, ok := flags(t, m.broker(t).Args)["broker-socket-group"]; ok {
		gid, err := strconv.ParseInt(g, 10, 64)
		if err != nil {
			t.Fatalf("--broker-socket-group=%q: the image may not list the name; give a gid", g)
		}
		return gid
	}
	if sc := m.daemonSets[0].Spec.Template.Spec.SecurityContext; sc != nil && sc.RunAsGroup != nil {
		return *sc.RunAsGroup
	}
	return -1
}

// checkRestricted checks a container's security context: no privilege, no
// escalation, every capability dropped, the RuntimeDefault seccomp profile,
// and with readOnly a read-only root filesystem.
func checkRestricted(t *testing.T, who string, pod *corev1.PodSecurityContext, c *corev1.SecurityContext, readOnly bool) {
	t.Helper()
	switch {
	case pod == nil || pod.RunAsNonRoot == nil || !*pod.RunAsNonRoot:
		t.Errorf("%s: the pod does not set runAsNonRoot", who)
	case pod.SeccompProfile == nil || pod.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault:
		t.Errorf("%s: the pod's seccomp profile is not RuntimeDefault", who)
	}
	switch {
	case c == nil:
		t.Errorf("%s: no securityContext", who)
	case c.Privileged != nil && *c.Privileged:
		t.Errorf("%s: privileged", who)
	case c.AllowPrivilegeEscalation == nil || *c.AllowPrivilegeEscalation:
		t.Errorf("%s: allowPrivilegeEscalation is not false", who)
	case c.Capabilities == nil || !slices.Equal(c.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(c.Capabilities.Add) > 0:
		t.Errorf("%s: capabilities are not drop [ALL]", who)
	case c.RunAsNonRoot != nil && !*c.RunAsNonRoot, c.RunAsUser != nil && *c.RunAsUser == 0:
		t.Errorf("%s: runs as root", who)
	case readOnly && (c.ReadOnlyRootFilesystem == nil || !*c.ReadOnlyRootFilesystem):
		t.Errorf("%s: the root filesystem is writable", who)
	}
}

// splitHostPort splits "host:port" (host may be empty) and returns the port.
func splitHostPort(addr string) (string, int32, error) {
	i := strings.LastIndexByte(addr, ':')
	if i < 0 {
		return "", 0, fmt.Errorf("%q has no port", addr)
	}
	p, err := strconv.ParseInt(addr[i+1:], 10, 32)
	if err != nil || p <= 0 || p > 65535 {
		return "", 0, fmt.Errorf("%q: bad port", addr)
	}
	return addr[:i], int32(p), nil
}

func TestExampleJobPod(t *testing.T) {
	m := loadManifests(t)
	pod := &m.pods[0]
	c := m.job(t)
	bf := flags(t, m.broker(t).Args)
	sock := bf["broker-socket"]

	// The broker's socket, through the same host directory.
	if v, _ := env(c, "ALLOCD_BROKER"); v != "unix://"+sock {
		t.Errorf("ALLOCD_BROKER=%q, the broker listens on %s", v, sock)
	}
	bv, _ := mountOf(t, &m.daemonSets[0].Spec.Template.Spec, m.broker(t), filepath.Dir(sock))
	v, _ := mountOf(t, &pod.Spec, c, filepath.Dir(sock))
	if v.HostPath == nil || bv.HostPath == nil || v.HostPath.Path != bv.HostPath.Path {
		t.Errorf("the job mounts %+v at %s, the broker %+v", v.VolumeSource, filepath.Dir(sock), bv.VolumeSource)
	}

	// Allowed onto the socket: its group, and a uid of its tenant.
	gid := socketGroup(t, m)
	sc := pod.Spec.SecurityContext
	if sc == nil || !slices.Contains(sc.SupplementalGroups, gid) {
		t.Errorf("the job is not in the socket's group %d", gid)
	}
	name, _ := env(c, "ALLOCD_TENANT")
	tf, err := parseTenants([]byte(m.configMaps[0].Data["tenants.yaml"]))
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(tf.Tenants, func(tn tenant) bool { return tn.Name == name })
	if i < 0 {
		t.Fatalf("ALLOCD_TENANT=%q is no tenant of the ConfigMap", name)
	}
	if uids := tf.Tenants[i].UIDs; len(uids) > 0 && (sc.RunAsUser == nil || !slices.Contains(uids, uint32(*sc.RunAsUser))) {
		t.Errorf("tenant %s allows uids %v; the job runs as %s", name, uids, deref(sc.RunAsUser))
	}
	if pod.Labels["allocd.io/tenant"] != name {
		t.Errorf("label allocd.io/tenant=%q, ALLOCD_TENANT=%q", pod.Labels["allocd.io/tenant"], name)
	}

	// Its metrics.
	listen, _ := env(c, "ALLOCD_METRICS_LISTEN")
	_, p, err := splitHostPort(listen)
	if err != nil {
		t.Fatalf("ALLOCD_METRICS_LISTEN: %v", err)
	}
	if got := port(t, c, "allocd-metrics").ContainerPort; got != p {
		t.Errorf("port allocd-metrics is %d, ALLOCD_METRICS_LISTEN=%q", got, listen)
	}

	// A GPU.
	if q := c.Resources.Limits[corev1.ResourceName("nvidia.com/gpu")]; q.Value() < 1 {
		t.Error("the job asks for no nvidia.com/gpu")
	}
	checkRestricted(t, "job", pod.Spec.SecurityContext, c.SecurityContext, false)
}

// ---- the tenants file ----

// tenantsFile is the schema of the broker's tenants file, as the tests
// read it; package broker owns the real parser.
type tenantsFile struct {
	Tenants []tenant `json:"tenants"`
}

type tenant struct {
	Name  string              `json:"name"`
	Quota *byteSize           `json:"quota,omitempty"`
	UIDs  []uint32            `json:"uids,omitempty"`
	GPUs  map[string]byteSize `json:"gpus,omitempty"`
}

// byteSize is a number of bytes, or a number with a binary unit: 60GiB,
// 1.5 TiB, 512MiB.
type byteSize int64

var sizeRE = regexp.MustCompile(`^([0-9]+(?:\.[0-9]+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?$`)

func (s *byteSize) UnmarshalJSON(b []byte) error {
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	str := strings.TrimSpace(fmt.Sprint(v))
	m := sizeRE.FindStringSubmatch(str)
	if m == nil {
		return fmt.Errorf("size %q: want bytes, or a number with KiB, MiB, GiB or TiB", str)
	}
	n, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		return err
	}
	shift := map[string]uint{"": 0, "B": 0, "KiB": 10, "KB": 10, "MiB": 20, "MB": 20, "GiB": 30, "GB": 30, "TiB": 40, "TB": 40}[m[2]]
	*s = byteSize(n * float64(uint64(1)<<shift))
	if *s < 1 {
		return fmt.Errorf("size %q: want at least one byte", str)
	}
	return nil
}

var (
	tenantNameRE = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)
	gpuKeyRE     = regexp.MustCompile(`^([0-9]+|GPU-[0-9a-fA-F-]+|MIG-[0-9a-fA-F-]+)$`)
)

func parseTenants(b []byte) (*tenantsFile, error) {
	var f tenantsFile
	if err := decodeStrict(b, &f); err != nil {
		return nil, err
	}
	if len(f.Tenants) == 0 {
		return nil, fmt.Errorf("no tenant")
	}
	seen := map[string]bool{}
	for _, tn := range f.Tenants {
		if !tenantNameRE.MatchString(tn.Name) {
			return nil, fmt.Errorf("tenant name %q: want 1 to 64 of [A-Za-z0-9_.-]", tn.Name)
		}
		if seen[tn.Name] {
			return nil, fmt.Errorf("tenant %q given twice", tn.Name)
		}
		seen[tn.Name] = true
		for k := range tn.GPUs {
			if !gpuKeyRE.MatchString(k) {
				return nil, fmt.Errorf("tenant %q: gpu %q: want an index or a UUID", tn.Name, k)
			}
		}
	}
	return &f, nil
}

func TestTenantsFile(t *testing.T) {
	m := loadManifests(t)
	raw, ok := m.configMaps[0].Data["tenants.yaml"]
	if !ok {
		t.Fatalf("the ConfigMap has no tenants.yaml: %v", m.configMaps[0].Data)
	}
	f, err := parseTenants([]byte(raw))
	if err != nil {
		t.Fatalf("tenants.yaml: %v", err)
	}
	unlimited, overridden := false, false
	for _, tn := range f.Tenants {
		unlimited = unlimited || tn.Quota == nil
		overridden = overridden || len(tn.GPUs) > 0
	}
	if !unlimited || !overridden {
		t.Error("the example shows no tenant without a quota, or none with a per-GPU quota")
	}

	// The test's parser is as strict as the broker's.
	for _, bad := range []string{
		"tenants:\n  - name: a\n    quota: 1GiB\n    qouta: 2GiB\n",
		"tenants:\n  - name: a b\n",
		"tenants:\n  - name: a\n  - name: a\n",
		"tenants:\n  - name: a\n    quota: lots\n",
		"tenants:\n  - name: a\n    quota: 0\n",
		"tenants:\n  - name: a\n    gpus:\n      first: 1GiB\n",
		"tenant:\n  - name: a\n",
	} {
		if _, err := parseTenants([]byte(bad)); err == nil {
			t.Errorf("parsed without error:\n%s", bad)
		}
	}
}

// ---- Prometheus: PodMonitors, rules, scrapes ----

// scrapeFiles says which scrape file holds what each PodMonitor's targets
// serve.
var scrapeFiles = map[string]string{
	"allocd-broker": "broker.prom",
	"allocd-jobs":   "job.prom",
}

// operatorTargetLabels are the labels Prometheus and the Prometheus
// Operator put on every series of a PodMonitor's targets.
var operatorTargetLabels = newLabelSet("job", "instance", "namespace", "pod", "container", "endpoint")

// metaLabels are the pod metadata labels the relabelings may read besides
// the pods' own labels.
var metaLabels = newLabelSet("__meta_kubernetes_namespace", "__meta_kubernetes_pod_name",
	"__meta_kubernetes_pod_node_name", "__meta_kubernetes_pod_container_name")

func loadPodMonitors(t *testing.T) []monitoringv1.PodMonitor {
	t.Helper()
	file := filepath.Join("prometheus", "podmonitors.yaml")
	var pms []monitoringv1.PodMonitor
	for i, doc := range readDocs(t, file) {
		var pm monitoringv1.PodMonitor
		if err := decodeStrict(doc, &pm); err != nil {
			t.Fatalf("%s, document %d: %v", file, i+1, err)
		}
		if pm.APIVersion != "monitoring.coreos.com/v1" || pm.Kind != "PodMonitor" {
			t.Fatalf("%s, document %d: %s %s", file, i+1, pm.APIVersion, pm.Kind)
		}
		pms = append(pms, pm)
	}
	return pms
}

var notLabelChar = regexp.MustCompile(`[^a-zA-Z0-9_]`)

// loadWorld reads the manifests, the PodMonitors and the scrape files, and
// checks that each PodMonitor selects its pods and scrapes a port they
// have. The scrapes it returns hold the series each PodMonitor keeps, with
// the target labels it adds.
func loadWorld(t *testing.T) *world {
	t.Helper()
	m := loadManifests(t)
	ds := &m.daemonSets[0]
	pods := map[string]struct {
		namespace string
		labels    map[string]string
		spec      *corev1.PodSpec
	}{
		"allocd-broker": {ds.Namespace, ds.Spec.Template.Labels, &ds.Spec.Template.Spec},
		"allocd-jobs":   {"", m.pods[0].Labels, &m.pods[0].Spec},
	}
	w := &world{}
	seen := map[string]bool{}
	for _, pm := range loadPodMonitors(t) {
		name := pm.Name
		file, ok := scrapeFiles[name]
		if !ok {
			t.Fatalf("PodMonitor %s: the test knows no scrape file for it", name)
		}
		seen[name] = true
		pod := pods[name]
		sel, err := metav1.LabelSelectorAsSelector(&pm.Spec.Selector)
		if err != nil {
			t.Fatalf("PodMonitor %s: %v", name, err)
		}
		if sel.Empty() || !sel.Matches(k8slabels.Set(pod.labels)) {
			t.Errorf("PodMonitor %s: selector %s does not select the pods %v", name, sel, pod.labels)
		}
		if nsSel := pm.Spec.NamespaceSelector; pod.namespace != "" && !nsSel.Any && !slices.Contains(nsSel.MatchNames, pod.namespace) {
			t.Errorf("PodMonitor %s: namespaceSelector leaves out %s", name, pod.namespace)
		}
		job := pm.Namespace + "/" + pm.Name
		if pm.Spec.JobLabel != "" {
			job = pod.labels[pm.Spec.JobLabel]
			if job == "" {
				t.Errorf("PodMonitor %s: jobLabel %s is not a label of the pods", name, pm.Spec.JobLabel)
			}
		}
		w.jobs = append(w.jobs, job)
		if len(pm.Spec.PodMetricsEndpoints) != 1 {
			t.Fatalf("PodMonitor %s: %d endpoints, want 1", name, len(pm.Spec.PodMetricsEndpoints))
		}
		ep := pm.Spec.PodMetricsEndpoints[0]
		if ep.Port == nil || !slices.ContainsFunc(pod.spec.Containers, func(c corev1.Container) bool {
			return slices.ContainsFunc(c.Ports, func(p corev1.ContainerPort) bool { return p.Name == *ep.Port })
		}) {
			t.Errorf("PodMonitor %s: port %s is no named port of the pods", name, deref(ep.Port))
		}
		if ep.Path != "" && ep.Path != "/metrics" {
			t.Errorf("PodMonitor %s: path %s: allocd serves /metrics", name, ep.Path)
		}

		s := scrape{file: file, series: readScrape(t, filepath.Join("testdata", file)), target: operatorTargetLabels}
		for _, rc := range ep.RelabelConfigs {
			for _, l := range rc.SourceLabels {
				src := string(l)
				if podLabel, ok := strings.CutPrefix(src, "__meta_kubernetes_pod_label_"); ok {
					if !slices.ContainsFunc(keys(pod.labels), func(k string) bool { return notLabelChar.ReplaceAllString(k, "_") == podLabel }) {
						t.Errorf("PodMonitor %s: relabeling reads %s; the pods have no such label", name, src)
					}
				} else if !metaLabels[src] {
					t.Errorf("PodMonitor %s: relabeling reads %s, which the test does not know", name, src)
				}
			}
			if rc.TargetLabel != "" {
				s.target = s.target.union(newLabelSet(rc.TargetLabel))
			}
		}
		for _, rc := range ep.MetricRelabelConfigs {
			if len(rc.SourceLabels) != 1 || rc.SourceLabels[0] != model.MetricNameLabel {
				t.Errorf("PodMonitor %s: a metric relabeling on %v, which the test does not model", name, rc.SourceLabels)
				continue
			}
			s.filter(t, name, rc)
		}
		w.scrapes = append(w.scrapes, s)
	}
	for name := range scrapeFiles {
		if !seen[name] {
			t.Errorf("no PodMonitor %s", name)
		}
	}
	return w
}

// filter applies a metric relabeling on __name__ (keep or drop) to the
// series of s, and checks that its regex matches some.
func (s *scrape) filter(t *testing.T, pm string, rc monitoringv1.RelabelConfig) {
	t.Helper()
	re, err := regexp.Compile("^(?:" + rc.Regex + ")$")
	if err != nil {
		t.Errorf("PodMonitor %s: regex %q: %v", pm, rc.Regex, err)
		return
	}
	keep := strings.EqualFold(rc.Action, "keep")
	if !keep && !strings.EqualFold(rc.Action, "drop") {
		t.Errorf("PodMonitor %s: metric relabeling action %q, which the test does not model", pm, rc.Action)
		return
	}
	matched := 0
	for name := range s.series {
		if re.MatchString(name) {
			matched++
		}
		if re.MatchString(name) != keep {
			delete(s.series, name)
		}
	}
	if matched == 0 {
		t.Errorf("PodMonitor %s: metric relabeling regex %q matches no series of %s", pm, rc.Regex, s.file)
	}
}

// deref formats *p, or "nothing" where p is nil.
func deref[T any](p *T) string {
	if p == nil {
		return "nothing"
	}
	return fmt.Sprint(*p)
}

func keys(m map[string]string) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

func TestPodMonitors(t *testing.T) {
	w := loadWorld(t)
	for _, s := range w.scrapes {
		if len(s.series) == 0 {
			t.Errorf("%s: the PodMonitor keeps no series", s.file)
		}
	}
}

var labelRef = regexp.MustCompile(`\$labels\.([A-Za-z_][A-Za-z0-9_]*)`)

func TestPrometheusRules(t *testing.T) {
	w := loadWorld(t)
	file := filepath.Join("prometheus", "rules.yaml")
	docs := readDocs(t, file)
	if len(docs) != 1 {
		t.Fatalf("%s: %d documents, want 1", file, len(docs))
	}
	var pr monitoringv1.PrometheusRule
	if err := decodeStrict(docs[0], &pr); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	if pr.APIVersion != "monitoring.coreos.com/v1" || pr.Kind != "PrometheusRule" {
		t.Fatalf("%s: %s %s", file, pr.APIVersion, pr.Kind)
	}

	// The spec is a Prometheus rule file: Prometheus's own parser, strict,
	// checks it, templates included.
	var raw struct {
		Spec json.RawMessage `json:"spec"`
	}
	if err := yaml.Unmarshal(docs[0], &raw); err != nil {
		t.Fatal(err)
	}
	spec, err := yaml.JSONToYAML(raw.Spec)
	if err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	groups, errs := rulefmt.Parse(spec, false, model.LegacyValidation, promql, slog.New(slog.NewTextHandler(&logs, nil)))
	for _, err := range errs {
		t.Errorf("%s: rulefmt: %v", file, err)
	}
	if logs.Len() > 0 {
		t.Errorf("%s: rulefmt: %s", file, logs.String())
	}
	if groups == nil {
		t.FailNow()
	}

	n := 0
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			n++
			where := g.Name + "/" + r.Alert + r.Record
			if r.Alert == "" {
				t.Errorf("%s: not an alert", where)
				continue
			}
			if s := r.Labels["severity"]; s != "critical" && s != "warning" && s != "info" {
				t.Errorf("%s: severity %q", where, s)
			}
			for _, a := range []string{"summary", "description"} {
				if strings.TrimSpace(r.Annotations[a]) == "" {
					t.Errorf("%s: no %s", where, a)
				}
			}
			e, _ := checkExpr(t, w, where, r.Expr)
			if e == nil {
				continue
			}
			out, ok := w.outLabels(e)
			if !ok {
				t.Errorf("%s: the test cannot tell the labels of %s", where, r.Expr)
				continue
			}
			for a, text := range r.Annotations {
				for _, ref := range labelRef.FindAllStringSubmatch(text, -1) {
					if !out[ref[1]] {
						t.Errorf("%s: annotation %s uses $labels.%s; the alert's series carry %s", where, a, ref[1], out)
					}
				}
			}
		}
	}
	if n == 0 {
		t.Errorf("%s: no rule", file)
	}
}

// ---- the Grafana dashboard ----

type dashPanel struct {
	ID        int    `json:"id"`
	Type      string `json:"type"`
	Title     string `json:"title"`
	Collapsed bool   `json:"collapsed"`
	GridPos   struct {
		H, W, X, Y int
	} `json:"gridPos"`
	Targets []struct {
		Expr         string `json:"expr"`
		LegendFormat string `json:"legendFormat"`
		RefID        string `json:"refId"`
	} `json:"targets"`
	Panels []dashPanel `json:"panels"`
}

type dashboard struct {
	Panels     []dashPanel `json:"panels"`
	Templating struct {
		List []struct {
			Name  string          `json:"name"`
			Type  string          `json:"type"`
			Query json.RawMessage `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

const dashboardFile = "../docs/grafana-dashboard.json"

var (
	grafanaVar   = regexp.MustCompile(`\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?`)
	legendLabel  = regexp.MustCompile(`\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}`)
	labelValues  = regexp.MustCompile(`^label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\)$`)
	grafanaTimes = map[string]string{"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
)

func TestDashboard(t *testing.T) {
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	// Formatted as written: two-space indent, a final newline.
	var compact, indented bytes.Buffer
	if err := json.Compact(&compact, b); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	if err := json.Indent(&indented, compact.Bytes(), "", "  "); err != nil {
		t.Fatal(err)
	}
	indented.WriteByte('\n')
	if !bytes.Equal(indented.Bytes(), b) {
		t.Errorf("%s is not formatted with a two-space indent", dashboardFile)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}

	w := loadWorld(t)
	vars := map[string]bool{}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
	}
	for _, want := range []string{"tenant", "gpu", "instance"} {
		if !vars[want] {
			t.Errorf("no %s variable", want)
		}
	}
	// subst replaces Grafana's variables: the time ones by a duration,
	// the dashboard's by a regex that matches anything.
	subst := func(where, expr string) string {
		return grafanaVar.ReplaceAllStringFunc(expr, func(s string) string {
			name := grafanaVar.FindStringSubmatch(s)[1]
			if d, ok := grafanaTimes[name]; ok {
				return d
			}
			if !vars[name] {
				t.Errorf("%s: %s is no variable of the dashboard", where, s)
			}
			return ".*"
		})
	}

	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct{ Query string }
		if err := json.Unmarshal(v.Query, &q); err != nil {
			if err := json.Unmarshal(v.Query, &q.Query); err != nil {
				t.Fatalf("variable %s: query %s", v.Name, v.Query)
			}
		}
		where := "variable " + v.Name
		lv := labelValues.FindStringSubmatch(q.Query)
		if lv == nil {
			t.Errorf("%s: %q is not label_values(selector, label)", where, q.Query)
			continue
		}
		e, names := checkExpr(t, w, where, subst(where, lv[1]))
		if e == nil {
			continue
		}
		for _, n := range names {
			if ls, _ := w.labels(n); !ls[lv[2]] {
				t.Errorf("%s: %s has no label %s", where, n, lv[2])
			}
		}
	}
	if got := queryOf(t, d, "tenant"); got != "label_values(allocd_broker_granted_bytes, tenant)" {
		t.Errorf("variable tenant: query %q", got)
	}

	ids := map[int]string{}
	var all []dashPanel
	checkLayout(t, "", d.Panels)
	for _, p := range d.Panels {
		all = append(all, p)
		if p.Type == "row" {
			checkLayout(t, p.Title, p.Panels)
			for _, q := range p.Panels {
				if q.GridPos.Y <= p.GridPos.Y {
					t.Errorf("panel %q of row %q lies above the row", q.Title, p.Title)
				}
			}
			all = append(all, p.Panels...)
		} else if len(p.Panels) > 0 {
			t.Errorf("panel %q holds panels but is no row", p.Title)
		}
	}
	metrics := 0
	for _, p := range all {
		if prev, dup := ids[p.ID]; dup || p.ID == 0 {
			t.Errorf("panels %q and %q: id %d", prev, p.Title, p.ID)
		}
		ids[p.ID] = p.Title
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q queries nothing", p.Title)
		}
		for _, tg := range p.Targets {
			where := fmt.Sprintf("panel %q, query %s", p.Title, tg.RefID)
			e, names := checkExpr(t, w, where, subst(where, tg.Expr))
			metrics += len(names)
			if e == nil {
				continue
			}
			out, ok := w.outLabels(e)
			if !ok {
				t.Errorf("%s: the test cannot tell the labels of %s", where, tg.Expr)
				continue
			}
			for _, l := range legendLabel.FindAllStringSubmatch(tg.LegendFormat, -1) {
				if !out[l[1]] {
					t.Errorf("%s: the legend uses %s; the series carry %s", where, l[1], out)
				}
			}
		}
	}
	if metrics == 0 {
		t.Error("the dashboard queries no metric")
	}
}

func queryOf(t *testing.T, d dashboard, name string) string {
	t.Helper()
	for _, v := range d.Templating.List {
		if v.Name == name {
			var q struct{ Query string }
			if json.Unmarshal(v.Query, &q) == nil {
				return q.Query
			}
		}
	}
	return ""
}

// checkLayout checks that panels lie within the dashboard's 24 columns and
// that none overlaps another.
func checkLayout(t *testing.T, row string, panels []dashPanel) {
	t.Helper()
	for i, p := range panels {
		g := p.GridPos
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.Y < 0 || g.X+g.W > 24 {
			t.Errorf("row %q: panel %q: gridPos %+v", row, p.Title, g)
		}
		for _, q := range panels[:i] {
			h := q.GridPos
			if g.X < h.X+h.W && h.X < g.X+g.W && g.Y < h.Y+h.H && h.Y < g.Y+g.H {
				t.Errorf("row %q: panels %q and %q overlap", row, q.Title, p.Title)
			}
		}
	}
}

// ---- the scrape files ----

var documented = regexp.MustCompile("(?m)^\\| `(allocd_[a-z0-9_]+)")

// TestJobScrapeDocumented checks that every allocd metric of the job's
// scrape is one docs/metrics.md describes, so the sample cannot drift into
// names allocd does not have.
func TestJobScrapeDocumented(t *testing.T) {
	doc, err := os.ReadFile("../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	known := map[string]bool{}
	for _, m := range documented.FindAllStringSubmatch(string(doc), -1) {
		known[m[1]] = true
	}
	if len(known) == 0 {
		t.Fatal("docs/metrics.md documents no allocd metric")
	}
	series := readScrape(t, filepath.Join("testdata", "job.prom"))
	for name := range series {
		if !strings.HasPrefix(name, "allocd_") {
			continue // go_*, process_*: not allocd's to document
		}
		base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(name, "_bucket"), "_sum"), "_count")
		if !known[name] && !known[base] {
			t.Errorf("job.prom: %s is not in docs/metrics.md", name)
		}
	}
	for name := range known {
		if _, ok := series[name]; !ok {
			if _, ok := series[name+"_bucket"]; !ok {
				t.Logf("job.prom has no %s", name)
			}
		}
	}
}
