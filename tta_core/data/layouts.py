"""The folder layouts `tta bench --data KIND:DIR` reads (no numpy: `tta bench --help`
prints them without importing the loaders)."""

DATA_KINDS: tuple[str, ...] = ("cifar10c", "imagenet-c", "folder", "bag", "cityscapes", "acdc")
# segmentation data (images with train-id masks: tta_core.data.segmentation)
SEG_DATA_KINDS: tuple[str, ...] = ("cityscapes", "acdc")
LAYOUTS: dict[str, str] = {
    "cifar10c": "DIR/<corruption>.npy arrays (5*n, 32, 32, 3) uint8 holding severities 1-5 "
                "in blocks of n, and DIR/labels.npy with their 5*n labels (CIFAR-10-C)",
    "imagenet-c": "DIR/<corruption>/<severity 1-5>/<class>/*.JPEG (ImageNet-C; every class "
                  "folder, since labels are positions in sorted order)",
    "folder": "DIR/<domain>/<class>/*.png|jpg|jpeg (domains in sorted order, labels are "
              "positions of the sorted class folder names)",
    "bag": "a rosbag2 folder (MCAP or sqlite3) with sensor_msgs/Image on /camera/image_raw, "
           "labels and domains from /ground_truth and /ground_truth/domain when recorded "
           "(`tta make-bag` writes them; without them accuracy is agreement with the "
           "unadapted model)",
    "cityscapes": "DIR/leftImg8bit/<split>/<city>/*_leftImg8bit.png with DIR/gtFine/<split>/"
                  "<city>/*_gtFine_labelTrainIds.png (Cityscapes train ids, 255 ignore; "
                  "segmentation)",
    "acdc": "DIR/rgb_anon/<condition>/<split>/<seq>/*_rgb_anon.png with DIR/gt/<condition>/"
            "<split>/<seq>/*_gt_labelTrainIds.png (ACDC: fog, night, rain, snow; "
            "segmentation)",
}
