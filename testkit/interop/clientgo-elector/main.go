// clientgo-elector contends for a Lease with client-go's own leader election
// (k8s.io/client-go/tools/leaderelection, resourcelock.LeaseLock, ReleaseOnCancel), so the
// interoperability test can put lease-sidecar next to the reference implementation.
//
// It prints one JSON object per line on stdout, each with "event", "identity" and "at"
// (wall clock, Unix seconds with a fraction, taken on this host):
//
//	started   OnStartedLeading ran: from here on this process leads
//	stopped   OnStoppedLeading ran: it no longer leads (client-go calls it after the
//	          release on cancel has been written)
//	wrote     a Create or Update of the Lease naming this process succeeded; carries
//	          "renew_time" and "lease_seconds" as written, so a test can tell until when
//	          the lease it wrote is valid by client-go's rules (used after a SIGKILL),
//	          and "resource_version", the Lease's as read right after the write (that
//	          write's own while nobody else writes: a term's token, as lease-sidecar
//	          counts them, is 2^52 + its acquiring write's resourceVersion)
//	signal    SIGTERM or SIGINT arrived; the context is cancelled
//	exit      the elector returned; the process exits 0
//
// The lock is client-go's LeaseLock, unchanged; the wrapper only reports successful
// writes. SIGTERM cancels the context, client-go releases the lease (ReleaseOnCancel),
// runs OnStoppedLeading, and the process exits.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

var (
	outMu    sync.Mutex
	identity string
)

func emit(event string, fields map[string]any) {
	line := map[string]any{"event": event, "identity": identity,
		"at": float64(time.Now().UnixNano()) / 1e9}
	for k, v := range fields {
		line[k] = v
	}
	data, _ := json.Marshal(line)
	outMu.Lock()
	defer outMu.Unlock()
	os.Stdout.Write(append(data, '\n'))
	os.Stdout.Sync()
}

// reporting delegates every call to client-go's LeaseLock and reports our own writes.
type reporting struct {
	resourcelock.Interface
	lock *resourcelock.LeaseLock
}

func (r reporting) report(ctx context.Context, rec resourcelock.LeaderElectionRecord) {
	if rec.HolderIdentity != identity {
		return // the release on cancel: not a claim
	}
	version := ""
	meta := r.lock.LeaseMeta
	if lease, err := r.lock.Client.Leases(meta.Namespace).Get(ctx, meta.Name,
		metav1.GetOptions{}); err == nil {
		version = lease.ResourceVersion
	}
	emit("wrote", map[string]any{
		"renew_time":       float64(rec.RenewTime.UnixNano()) / 1e9,
		"lease_seconds":    rec.LeaseDurationSeconds,
		"transitions":      rec.LeaderTransitions,
		"resource_version": version,
	})
}

func (r reporting) Create(ctx context.Context, rec resourcelock.LeaderElectionRecord) error {
	err := r.Interface.Create(ctx, rec)
	if err == nil {
		r.report(ctx, rec)
	}
	return err
}

func (r reporting) Update(ctx context.Context, rec resourcelock.LeaderElectionRecord) error {
	err := r.Interface.Update(ctx, rec)
	if err == nil {
		r.report(ctx, rec)
	}
	return err
}

func main() {
	kubeconfig := flag.String("kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig file")
	namespace := flag.String("namespace", "default", "namespace of the Lease")
	name := flag.String("lease", "", "name of the Lease object")
	flag.StringVar(&identity, "identity", "", "this contender's identity")
	leaseDuration := flag.Duration("lease-duration", 3*time.Second, "LeaseDuration")
	renewDeadline := flag.Duration("renew-deadline", 2*time.Second, "RenewDeadline")
	retryPeriod := flag.Duration("retry-period", 250*time.Millisecond, "RetryPeriod")
	coordinated := flag.Bool("coordinated", false,
		"Coordinated: renew only a Lease naming us (as coordinated leader election's "+
			"controller sets it) and end the term once preferredHolder is set")
	flag.Parse()
	if *name == "" || identity == "" {
		fmt.Fprintln(os.Stderr, "clientgo-elector: -lease and -identity are required")
		os.Exit(2)
	}

	config, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		fmt.Fprintf(os.Stderr, "clientgo-elector: kubeconfig: %v\n", err)
		os.Exit(2)
	}
	client := kubernetes.NewForConfigOrDie(config)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		sig := <-signals
		emit("signal", map[string]any{"signal": sig.String()})
		cancel()
	}()

	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Name: *name, Namespace: *namespace},
		Client:     client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: identity},
	}
	leaderelection.RunOrDie(ctx, leaderelection.LeaderElectionConfig{
		Lock:            reporting{lock, lock},
		Name:            *name,
		LeaseDuration:   *leaseDuration,
		RenewDeadline:   *renewDeadline,
		RetryPeriod:     *retryPeriod,
		ReleaseOnCancel: true,
		Coordinated:     *coordinated,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(context.Context) { emit("started", nil) },
			OnStoppedLeading: func() { emit("stopped", nil) },
		},
	})
	emit("exit", nil)
}
